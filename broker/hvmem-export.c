/*
 * hvmem: keys for exports of a region to other hosts (see hvmem-export.h).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * QEMU's tls-creds-psk with endpoint=server reads DIR/keys.psk at every
 * handshake (GnuTLS's password file), so what the file says when a client
 * connects is what admits it: the file is replaced whole (rename), never
 * edited in place.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "hvmem-export.h"
#include "psk.h"

#define KEYS_FILE       "keys.psk"
#define KEYS_TMP        ".keys.psk.new"

struct HvmExportKeys {
    HvmClient *c;
    char *region;
    bool rw;
    char *dir;
    int dfd;
    bool made_dir;
    char *written;          /* the file's content, as last written */
    bool warned;
};

/* @dir as a tls-creds-psk directory: ours, 0700; created when missing. */
static int open_dir(const char *dir, bool *made, GError **errp)
{
    struct stat st;
    int dfd;

    *made = mkdir(dir, 0700) == 0;
    if (!*made && errno != EEXIST) {
        g_set_error(errp, G_FILE_ERROR, g_file_error_from_errno(errno),
                    "cannot make the key directory %s: %s", dir, g_strerror(errno));
        return -1;
    }
    dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0 || fstat(dfd, &st) < 0) {
        g_set_error(errp, G_FILE_ERROR, g_file_error_from_errno(errno),
                    "key directory %s: %s", dir, g_strerror(errno));
        if (dfd >= 0) {
            close(dfd);
        }
        return -1;
    }
    if (st.st_uid != geteuid() || (st.st_mode & 077)) {
        g_set_error(errp, G_FILE_ERROR, G_FILE_ERROR_PERM,
                    "key directory %s: must be owned by uid %u and closed to "
                    "group and others (mode 0700); it is uid %u mode %04o",
                    dir, (unsigned)geteuid(), (unsigned)st.st_uid,
                    (unsigned)(st.st_mode & 07777));
        close(dfd);
        return -1;
    }
    return dfd;
}

/* Replace @dfd/keys.psk by @text (mode 0600) in one rename. */
static bool write_keys(int dfd, const char *dir, const char *text, GError **errp)
{
    size_t len = strlen(text), off = 0;
    int fd;

    unlinkat(dfd, KEYS_TMP, 0);
    fd = openat(dfd, KEYS_TMP, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
                O_CLOEXEC, 0600);
    if (fd < 0) {
        goto fail;
    }
    while (off < len) {
        ssize_t n = write(fd, text + off, len - off);

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            int e = errno;

            close(fd);
            errno = e;
            goto fail;
        }
        off += n;
    }
    if (close(fd) < 0 || renameat(dfd, KEYS_TMP, dfd, KEYS_FILE) < 0) {
        goto fail;
    }
    return true;
fail:
    g_set_error(errp, G_FILE_ERROR, g_file_error_from_errno(errno),
                "cannot write %s/%s: %s", dir, KEYS_FILE, g_strerror(errno));
    unlinkat(dfd, KEYS_TMP, 0);
    return false;
}

/* Ask the broker; the file's new text, or NULL with @errp set. */
static char *ask(HvmExportKeys *ek, GError **errp)
{
    g_auto(GStrv) lines = NULL;
    GString *s;

    if (!hvm_region_export_keys(ek->c, ek->region, ek->rw, &lines, errp)) {
        return NULL;
    }
    s = g_string_new(NULL);
    for (int i = 0; lines[i]; i++) {
        g_string_append_printf(s, "%s\n", lines[i]);
        explicit_bzero(lines[i], strlen(lines[i]));
    }
    return g_string_free(s, FALSE);
}

static void forget(char **text)
{
    if (*text) {
        explicit_bzero(*text, strlen(*text));
        g_clear_pointer(text, g_free);
    }
}

HvmExportKeys *hvm_export_keys_start(HvmClient *c, const char *region, bool rw,
                                     const char *dir, GError **errp)
{
    HvmExportKeys *ek = g_new0(HvmExportKeys, 1);
    char *text;

    ek->c = c;
    ek->region = g_strdup(region);
    ek->rw = rw;
    ek->dir = g_strdup(dir);
    ek->dfd = open_dir(dir, &ek->made_dir, errp);
    if (ek->dfd < 0) {
        hvm_export_keys_stop(ek);
        return NULL;
    }
    text = ask(ek, errp);
    if (!text || !write_keys(ek->dfd, dir, text, errp)) {
        forget(&text);
        hvm_export_keys_stop(ek);
        return NULL;
    }
    ek->written = text;
    return ek;
}

static void refresh(HvmExportKeys *ek)
{
    g_autoptr(GError) err = NULL;
    char *text = ask(ek, &err);

    if (!text) {
        /* Fail closed: without the broker's answer nobody new attaches. */
        if (!ek->warned) {
            fprintf(stderr, "hvmem: the broker did not answer for the export "
                    "of '%s' (%s): %s/%s now admits nobody\n", ek->region,
                    err->message, ek->dir, KEYS_FILE);
            ek->warned = true;
        }
        text = g_strdup("");
    } else {
        ek->warned = false;
    }
    if (!g_strcmp0(text, ek->written)) {
        forget(&text);
        return;
    }
    g_clear_error(&err);
    if (!write_keys(ek->dfd, ek->dir, text, &err)) {
        fprintf(stderr, "hvmem: %s\n", err->message);
        forget(&text);
        return;
    }
    forget(&ek->written);
    ek->written = text;
}

void hvm_export_keys_sigset(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGCHLD);
    sigaddset(set, SIGTERM);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGHUP);
}

int hvm_export_keys_wait(HvmExportKeys *ek, pid_t pid, int *status)
{
    struct timespec ts = { .tv_sec = HVM_EXPORT_REFRESH_S };
    sigset_t set;
    int sig;

    /* The caller blocked these before the fork: none is lost. */
    hvm_export_keys_sigset(&set);
    for (;;) {
        pid_t r = waitpid(pid, status, WNOHANG);

        if (r == pid) {
            return 0;
        }
        if (r < 0 && errno != EINTR) {
            perror("hvmem: waitpid");
            *status = W_EXITCODE(1, 0);
            return 0;
        }
        sig = sigtimedwait(&set, NULL, &ts);
        if (sig < 0 && errno == EAGAIN) {
            refresh(ek);
        } else if (sig > 0 && sig != SIGCHLD) {
            return sig;
        }
    }
}

void hvm_export_keys_stop(HvmExportKeys *ek)
{
    if (ek->dfd >= 0) {
        unlinkat(ek->dfd, KEYS_FILE, 0);
        close(ek->dfd);
        if (ek->made_dir) {
            rmdir(ek->dir);
        }
    }
    forget(&ek->written);
    g_free(ek->region);
    g_free(ek->dir);
    g_free(ek);
}

/*
 * psk REGION --identity ID --key-file FILE --dir DIR: on the remote
 * client's host, DIR/keys.psk with ID's key for exports of REGION (a
 * tls-creds-psk directory for endpoint=client,username=ID).
 */
int hvm_psk_verb(int argc, char **argv)
{
    const char *id = NULL, *key_file = NULL, *dir = NULL, *why;
    uint8_t key[HVM_PSK_KEY_MAX];
    char derived[HVM_PSK_DERIVED_HEX + 1];
    g_autoptr(GError) err = NULL;
    g_autofree char *text = NULL;
    size_t klen;
    bool made, ok;
    int dfd;

    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--identity")) {
            id = argv[i + 1];
        } else if (!strcmp(argv[i], "--key-file")) {
            key_file = argv[i + 1];
        } else if (!strcmp(argv[i], "--dir")) {
            dir = argv[i + 1];
        } else {
            id = NULL;
            break;
        }
    }
    if (argc % 2 || !id || !key_file || !dir) {
        fputs("usage: hvmem psk REGION --identity ID --key-file FILE --dir DIR\n",
              stderr);
        return 2;
    }
    if ((why = hvm_name_check(argv[1], strlen(argv[1])))) {
        fprintf(stderr, "hvmem: psk: invalid region name: %s\n", why);
        return 2;
    }
    if ((why = hvm_psk_identity_check(id))) {
        fprintf(stderr, "hvmem: psk: identity %s: %s\n", id, why);
        return 2;
    }
    klen = hvm_psk_read_key_file(key_file, key, &err);
    if (!klen) {
        fprintf(stderr, "hvmem: psk: %s\n", err->message);
        return 1;
    }
    hvm_psk_derive(key, klen, argv[1], derived);
    explicit_bzero(key, sizeof(key));
    text = g_strdup_printf("%s:%s\n", id, derived);
    explicit_bzero(derived, sizeof(derived));
    dfd = open_dir(dir, &made, &err);
    ok = dfd >= 0 && write_keys(dfd, dir, text, &err);
    explicit_bzero(text, strlen(text));
    if (dfd >= 0) {
        close(dfd);
    }
    if (!ok) {
        fprintf(stderr, "hvmem: psk: %s\n", err->message);
        return 1;
    }
    return 0;
}
