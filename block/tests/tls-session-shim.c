/*
 * An LD_PRELOAD shim for the TLS cipher test (test_tls_cipher.py): when a
 * GnuTLS handshake completes in the process, append one line to the file
 * $HYBRIDVM_TLS_LOG: the session's description as gnutls_session_get_desc()
 * gives it, e.g.
 * "(TLS1.3-PSK)-(ECDHE-SECP256R1)-(AES-128-GCM)".  QEMU says nothing of the
 * suite a session settled on; this lets a test read it from the real
 * qemu-nbd and qemu-io without changing either.
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <gnutls/gnutls.h>

int gnutls_handshake(gnutls_session_t session)
{
    static int (*real)(gnutls_session_t);
    const char *path = getenv("HYBRIDVM_TLS_LOG");
    int ret;

    if (!real) {
        real = (int (*)(gnutls_session_t))dlsym(RTLD_NEXT, "gnutls_handshake");
        if (!real) {
            abort();    /* the shim is only ever loaded into a GnuTLS user */
        }
    }
    ret = real(session);
    if (ret == 0 && path) {
        char *desc = gnutls_session_get_desc(session);
        FILE *f = fopen(path, "a");

        if (f) {
            fprintf(f, "%s\n", desc ? desc : "(none)");
            fclose(f);
        }
        gnutls_free(desc);
    }
    return ret;
}
