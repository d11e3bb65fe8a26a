/*
 * hvmemd: remote clients (docs/broker.md, "Remote clients").
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * A remote client is configured on the broker's host as
 *
 *   [remote-client hostA]
 *   key-file=/etc/hybridvm/remote/hostA.key
 *   user=hybrid-mirror
 *
 * and is judged as that user is: the region's mode bits decide whether it
 * may attach to an export of the region, as they decide for a local
 * process.  The broker never sends the secret: an export gets each
 * admitted client's key for that region alone (psk.h).
 */
#define _GNU_SOURCE
#include <grp.h>
#include <pwd.h>
#include <stdarg.h>
#include <string.h>

#include "hvmemd.h"

void hvmd_remote_free(gpointer p)
{
    HvmRemote *rc = p;

    explicit_bzero(rc->key, sizeof(rc->key));
    g_free(rc->name);
    g_free(rc);
}

static bool bad(GError **errp, const char *file, const char *group,
                const char *fmt, ...) G_GNUC_PRINTF(4, 5);

static bool bad(GError **errp, const char *file, const char *group,
                const char *fmt, ...)
{
    g_autofree char *why = NULL;
    va_list ap;

    va_start(ap, fmt);
    why = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    g_set_error(errp, G_KEY_FILE_ERROR, G_KEY_FILE_ERROR_INVALID_VALUE,
                "%s: [%s]: %s", file, group, why);
    return false;
}

bool hvmd_remote_parse(Broker *b, GKeyFile *kf, const char *file,
                       const char *group, GError **errp)
{
    const char *name = group + strlen("remote-client ");
    g_autofree char *key_file = g_key_file_get_value(kf, group, "key-file", NULL);
    g_autofree char *user = g_key_file_get_value(kf, group, "user", NULL);
    g_autofree char *grp = g_key_file_get_value(kf, group, "group", NULL);
    g_auto(GStrv) keys = g_key_file_get_keys(kf, group, NULL, NULL);
    const char *why = hvm_psk_identity_check(name);
    g_autoptr(GError) err = NULL;
    HvmRemote *rc;
    struct passwd *pw;

    if (why) {
        return bad(errp, file, group, "the client's name %s", why);
    }
    for (int i = 0; keys && keys[i]; i++) {
        if (strcmp(keys[i], "key-file") && strcmp(keys[i], "user") &&
            strcmp(keys[i], "group")) {
            return bad(errp, file, group, "unknown key %s= (expected key-file=, "
                       "user=, group=)", keys[i]);
        }
    }
    for (guint i = 0; i < b->remotes->len; i++) {
        if (!strcmp(((HvmRemote *)b->remotes->pdata[i])->name, name)) {
            return bad(errp, file, group, "a second client of that name");
        }
    }
    if (b->remotes->len == HVM_MAX_REMOTES) {
        return bad(errp, file, group, "more than %d remote clients",
                   HVM_MAX_REMOTES);
    }
    if (!key_file || !user) {
        return bad(errp, file, group, "key-file= and user= are required");
    }
    rc = g_new0(HvmRemote, 1);
    if (!hvmd_parse_uid(user, &rc->uid, &rc->gid) ||
        (grp && !hvmd_parse_gid(grp, &rc->gid))) {
        hvmd_remote_free(rc);
        return bad(errp, file, group, "unknown user or group");
    }
    if (rc->uid == 0) {
        /* uid 0 passes every check: a key would open every region. */
        hvmd_remote_free(rc);
        return bad(errp, file, group, "a remote client cannot act as root "
                   "(uid 0 may do anything here); name a user of its own");
    }
    pw = getpwuid(rc->uid);
    if (pw) {
        rc->ngroups = MAX_GROUPS;
        if (getgrouplist(pw->pw_name, rc->gid, rc->groups, &rc->ngroups) < 0) {
            hvmd_remote_free(rc);
            return bad(errp, file, group, "user %s is in more than %d groups",
                       pw->pw_name, MAX_GROUPS);
        }
    }
    rc->klen = hvm_psk_read_key_file(key_file, rc->key, &err);
    if (!rc->klen) {
        hvmd_remote_free(rc);
        return bad(errp, file, group, "%s", err->message);
    }
    rc->name = g_strdup(name);
    g_ptr_array_add(b->remotes, rc);
    g_message("remote client '%s' acts as uid %u gid %u", name, rc->uid, rc->gid);
    return true;
}

void hvmd_remote_keys(Broker *b, HvmRegion *r, unsigned want,
                      GByteArray *data, GString *who)
{
    guint count_at = data->len;
    uint32_t n = 0;

    hvm_put_u32(data, 0);
    if (!b->remotes->len) {
        g_string_append(who, "no remote client (none configured)");
    }
    for (guint i = 0; i < b->remotes->len; i++) {
        HvmRemote *rc = b->remotes->pdata[i];
        char key[HVM_PSK_DERIVED_HEX + 1];
        g_autofree char *line = NULL;

        if (!hvmd_may(rc->uid, rc->gid, rc->groups, rc->ngroups, r, want)) {
            continue;
        }
        hvm_psk_derive(rc->key, rc->klen, r->name, key);
        line = g_strdup_printf("%s:%s", rc->name, key);
        explicit_bzero(key, sizeof(key));
        hvm_put_u16(data, strlen(line));
        g_byte_array_append(data, (const guint8 *)line, strlen(line));
        explicit_bzero(line, strlen(line));
        g_string_append_printf(who, "%s'%s'", n ? ", " : "", rc->name);
        n++;
    }
    if (b->remotes->len && !n) {
        g_string_append(who, "no remote client (the region's mode admits none)");
    }
    n = GUINT32_TO_LE(n);
    memcpy(data->data + count_at, &n, sizeof(n));
}
