/*
 * Remote clients' keys (see psk.h).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "psk.h"

const char *hvm_psk_identity_check(const char *id)
{
    size_t len = strlen(id);

    if (len == 0 || len > HVM_PSK_IDENTITY_MAX) {
        return "must be 1 to 64 bytes long";
    }
    for (size_t i = 0; i < len; i++) {
        if (!g_ascii_isalnum(id[i]) && !strchr("._-", id[i])) {
            return "may hold only letters, digits, '.', '_' and '-'";
        }
    }
    return NULL;
}

size_t hvm_psk_key_parse(const char *text, size_t len,
                         uint8_t key[HVM_PSK_KEY_MAX], const char **why)
{
    size_t i = 0, n = 0;

    while (len && g_ascii_isspace(text[len - 1])) {
        len--;
    }
    while (i < len && g_ascii_isspace(text[i])) {
        i++;
    }
    if ((len - i) % 2) {
        *why = "an odd number of hex digits";
        return 0;
    }
    for (; i < len; i += 2) {
        int hi = g_ascii_xdigit_value(text[i]);
        int lo = g_ascii_xdigit_value(text[i + 1]);

        if (hi < 0 || lo < 0) {
            *why = "not hex digits only";
            return 0;
        }
        if (n == HVM_PSK_KEY_MAX) {
            *why = "longer than 64 bytes (128 hex digits)";
            return 0;
        }
        key[n++] = hi << 4 | lo;
    }
    if (n < HVM_PSK_KEY_MIN) {
        *why = "shorter than 16 bytes (32 hex digits)";
        return 0;
    }
    return n;
}

void hvm_psk_derive(const uint8_t *key, size_t klen, const char *region,
                    char out[HVM_PSK_DERIVED_HEX + 1])
{
    g_autoptr(GHmac) h = g_hmac_new(G_CHECKSUM_SHA256, key, klen);

    g_hmac_update(h, (const guchar *)HVM_PSK_CONTEXT, strlen(HVM_PSK_CONTEXT));
    g_hmac_update(h, (const guchar *)region, strlen(region));
    g_strlcpy(out, g_hmac_get_string(h), HVM_PSK_DERIVED_HEX + 1);
}

size_t hvm_psk_read_key_file(const char *path, uint8_t key[HVM_PSK_KEY_MAX],
                             GError **errp)
{
    char text[2 * HVM_PSK_KEY_MAX + 64];
    const char *why = NULL;
    struct stat st;
    ssize_t n;
    size_t klen = 0;
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);

    if (fd < 0) {
        g_set_error(errp, G_FILE_ERROR, g_file_error_from_errno(errno),
                    "key file %s: %s%s", path, g_strerror(errno),
                    errno == ELOOP ? " (a symbolic link: name the file itself)"
                    : "");
        return 0;
    }
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        why = "not a regular file";
    } else if (st.st_uid != 0 && st.st_uid != geteuid()) {
        why = "owned by another user, who could change the key";
    } else if (st.st_mode & 077) {
        why = "readable or writable by group or others (chmod 0600 it)";
    } else if ((n = read(fd, text, sizeof(text))) < 0) {
        why = g_strerror(errno);
    } else if ((size_t)n == sizeof(text)) {
        why = "too long for a key";
    } else {
        klen = hvm_psk_key_parse(text, n, key, &why);
    }
    explicit_bzero(text, sizeof(text));
    close(fd);
    if (!klen) {
        g_set_error(errp, G_FILE_ERROR, G_FILE_ERROR_INVAL, "key file %s: %s",
                    path, why);
    }
    return klen;
}
