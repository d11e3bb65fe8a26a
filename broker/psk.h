/*
 * Remote clients' keys (docs/broker.md, "Remote clients"): a remote client
 * of a broker is an identity with a secret key; an export of a region on
 * the broker's host accepts it with a key derived from that secret for
 * that region alone, so the process exporting one region never learns a
 * key that opens another.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * Pure functions but hvm_psk_read_key_file(), shared by hvmemd (which
 * derives the keys of the clients it admits) and hvmem (whose `psk` verb
 * derives a client's own key on the client's host).
 */
#ifndef HVM_PSK_H
#define HVM_PSK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <glib.h>

#define HVM_PSK_IDENTITY_MAX    64      /* bytes of a remote client's name */
#define HVM_PSK_KEY_MIN         16      /* bytes of secret: 32 hex digits */
#define HVM_PSK_KEY_MAX         64
#define HVM_PSK_DERIVED_HEX     64      /* HMAC-SHA256, in hex */
#define HVM_PSK_CONTEXT         "hybridvm-broker-export-v1:"
/* The most remote clients one broker knows (a reply's lines all fit). */
#define HVM_MAX_REMOTES         64

/*
 * An identity is 1..64 bytes of [A-Za-z0-9._-]: it goes into a PSK file
 * as "IDENTITY:KEY" and into TLS as the PSK username.  NULL when valid,
 * else a static reason.
 */
const char *hvm_psk_identity_check(const char *id);

/*
 * A key file's text: hex digits for 16..64 bytes, surrounding white space
 * allowed.  Returns the key's length, or 0 with @why set (static).
 */
size_t hvm_psk_key_parse(const char *text, size_t len,
                         uint8_t key[HVM_PSK_KEY_MAX], const char **why);

/*
 * The key an export of @region accepts from the holder of @key: hex of
 * HMAC-SHA256(@key, HVM_PSK_CONTEXT @region), NUL-terminated.
 */
void hvm_psk_derive(const uint8_t *key, size_t klen, const char *region,
                    char out[HVM_PSK_DERIVED_HEX + 1]);

/*
 * Read a secret key from @path: a regular file (never through a symbolic
 * link) owned by root or by this process's effective uid, not readable or
 * writable by group or others.  Returns its length, or 0 with @errp set.
 */
size_t hvm_psk_read_key_file(const char *path, uint8_t key[HVM_PSK_KEY_MAX],
                             GError **errp);

#endif
