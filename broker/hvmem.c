/*
 * hvmem: the memory broker's command line for people.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * hvmem [-s SOCKET] VERB ARGS...; exit status 0 on success, 1 when the
 * broker refused (its message on stderr), 2 on a usage error.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client.h"
#include "hvmem-export.h"
#include "hvmem-podman.h"

static const char usage[] =
    "usage: hvmem [-s SOCKET] VERB ARGS\n"
    "  create NAME SIZE [--mode OCTAL]   (mode default 0600; SIZE like 64M)\n"
    "  lookup NAME | destroy NAME | resize NAME SIZE | chmod NAME OCTAL\n"
    "  alloc REGION ITEM SIZE | item-lookup REGION ITEM | free REGION ITEM\n"
    "  stat [NAME]   (no NAME: the pool) | list\n"
    "  map NAME [--rw] [--psk-dir DIR] -- COMMAND [ARGS]   run COMMAND with\n"
    "      the region's fd in $HVMEM_FD (O_RDONLY, or O_RDWR holding the\n"
    "      read-write lease until COMMAND exits) and its size in $HVMEM_SIZE;\n"
    "      exits with its status.  --psk-dir: DIR/keys.psk holds the keys of\n"
    "      the remote clients the broker admits to an export of the region\n"
    "      (a tls-creds-psk dir), kept current while COMMAND runs\n"
    "  psk NAME --identity ID --key-file FILE --dir DIR   on a remote\n"
    "      client's host: DIR/keys.psk with ID's key for exports of NAME\n"
    "  podman-run NAME [--rw] -- PODMAN [OPTIONS] run [RUN-OPTIONS] IMAGE [ARGS]\n"
    "      run a podman container with the region bind-mounted at\n"
    "      /run/hvmem/NAME (read-only unless --rw; $HVMEM_REGION_PATH,\n"
    "      $HVMEM_SIZE); the region and its lease are held until the container\n"
    "      is gone, and it is removed when it exits; exits with its status\n"
    "SOCKET defaults to $HVMEM_SOCKET or /run/hybridvm-broker.sock\n";

static void print_region(const HvmRegionInfo *ri)
{
    printf("name=%s id=%" G_GUINT64_FORMAT " size=%" G_GUINT64_FORMAT
           " used=%" G_GUINT64_FORMAT " mode=%04o uid=%u gid=%u items=%u "
           "attached=%u leased=%s lease_pid=%u\n",
           ri->name, ri->id, ri->size, ri->used, ri->mode, ri->uid, ri->gid,
           ri->nitems, ri->attached,
           ri->flags & HVM_REGION_LEASED ? "yes" : "no", ri->lease_pid);
}

static void print_item(const char *region, const HvmItemInfo *ii)
{
    printf("region=%s item=%s offset=%" G_GUINT64_FORMAT " size=%"
           G_GUINT64_FORMAT "\n", region, ii->name, ii->offset, ii->size);
}

static bool parse_mode(const char *s, uint32_t *mode)
{
    char *end;
    unsigned long v = strtoul(s, &end, 8);

    if (!*s || *end || v & ~HVM_MODE_MASK) {
        fprintf(stderr, "hvmem: mode %s is not octal within 0666\n", s);
        return false;
    }
    *mode = v;
    return true;
}

static bool parse_size(const char *s, uint64_t *size)
{
    if (hvm_parse_size(s, size)) {
        fprintf(stderr, "hvmem: size %s is not a size (e.g. 4096, 64M, 2G)\n", s);
        return false;
    }
    return true;
}

/*
 * map NAME [--rw] [--psk-dir DIR] -- COMMAND...: the connection (and so the
 * lease) stays open in this process while COMMAND runs with the descriptor;
 * with --psk-dir, DIR/keys.psk holds the keys of the remote clients the
 * broker admits to COMMAND's export of the region, kept current meanwhile.
 */
static int map_and_run(HvmClient *c, int argc, char **argv, GError **err)
{
    bool rw = false;
    const char *psk_dir = NULL;
    HvmExportKeys *ek = NULL;
    sigset_t sigs, old;
    int i = 2, fd, status;
    HvmRegionInfo ri;
    char buf[32];
    pid_t pid;

    for (; argc > i && strcmp(argv[i], "--"); i++) {
        if (!strcmp(argv[i], "--rw")) {
            rw = true;
        } else if (!strcmp(argv[i], "--psk-dir") && argc > i + 1) {
            psk_dir = argv[++i];
        } else {
            break;
        }
    }
    if (argc < i + 2 || strcmp(argv[i], "--")) {
        fputs(usage, stderr);
        return 2;
    }
    fd = hvm_region_map(c, argv[1], rw, &ri, err);
    if (fd < 0) {
        return 1;
    }
    sigemptyset(&sigs);
    if (psk_dir) {
        hvm_export_keys_sigset(&sigs);
    }
    sigprocmask(SIG_BLOCK, &sigs, &old);
    if (psk_dir) {
        ek = hvm_export_keys_start(c, argv[1], rw, psk_dir, err);
        if (!ek) {
            close(fd);
            return 1;
        }
    }
    pid = fork();
    if (pid < 0) {
        perror("hvmem: fork");
        close(fd);
        if (ek) {
            hvm_export_keys_stop(ek);
        }
        return 1;
    }
    if (pid == 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        fcntl(fd, F_SETFD, 0);      /* COMMAND inherits it */
        snprintf(buf, sizeof(buf), "%d", fd);
        setenv("HVMEM_FD", buf, 1);
        snprintf(buf, sizeof(buf), "%" G_GUINT64_FORMAT, ri.size);
        setenv("HVMEM_SIZE", buf, 1);
        execvp(argv[i + 1], argv + i + 1);
        fprintf(stderr, "hvmem: cannot run %s: %s\n", argv[i + 1],
                g_strerror(errno));
        _exit(127);
    }
    close(fd);
    if (ek) {
        int sig = hvm_export_keys_wait(ek, pid, &status);

        /* Asked to go: no key left behind admits anyone new.  COMMAND runs on. */
        hvm_export_keys_stop(ek);
        if (sig) {
            signal(sig, SIG_DFL);
            sigprocmask(SIG_SETMASK, &old, NULL);
            raise(sig);
            return 128 + sig;
        }
    } else {
        while (waitpid(pid, &status, 0) < 0) {
            if (errno != EINTR) {
                perror("hvmem: waitpid");
                return 1;
            }
        }
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int run(HvmClient *c, int argc, char **argv, GError **err)
{
    const char *verb = argv[0];
    HvmRegionInfo ri;
    HvmItemInfo ii;
    uint64_t size;
    uint32_t mode = 0600;

#define NARGS(n) do { if (argc != (n) + 1) { goto bad; } } while (0)
    if (!strcmp(verb, "create")) {
        if (argc == 5 && !strcmp(argv[3], "--mode")) {
            if (!parse_mode(argv[4], &mode)) {
                return 2;
            }
        } else {
            NARGS(2);
        }
        if (!parse_size(argv[2], &size)) {
            return 2;
        }
        if (!hvm_region_create(c, argv[1], size, mode, &ri, err)) {
            return 1;
        }
        print_region(&ri);
    } else if (!strcmp(verb, "lookup")) {
        NARGS(1);
        if (!hvm_region_lookup(c, argv[1], &ri, err)) {
            return 1;
        }
        print_region(&ri);
    } else if (!strcmp(verb, "destroy")) {
        NARGS(1);
        if (!hvm_region_destroy(c, argv[1], err)) {
            return 1;
        }
    } else if (!strcmp(verb, "resize")) {
        NARGS(2);
        if (!parse_size(argv[2], &size)) {
            return 2;
        }
        if (!hvm_region_resize(c, argv[1], size, &ri, err)) {
            return 1;
        }
        print_region(&ri);
    } else if (!strcmp(verb, "chmod")) {
        NARGS(2);
        if (!parse_mode(argv[2], &mode)) {
            return 2;
        }
        if (!hvm_region_chmod(c, argv[1], mode, err)) {
            return 1;
        }
    } else if (!strcmp(verb, "alloc")) {
        NARGS(3);
        if (!parse_size(argv[3], &size)) {
            return 2;
        }
        if (!hvm_item_alloc(c, argv[1], argv[2], size, &ii, err)) {
            return 1;
        }
        print_item(argv[1], &ii);
    } else if (!strcmp(verb, "item-lookup")) {
        NARGS(2);
        if (!hvm_item_lookup(c, argv[1], argv[2], &ii, err)) {
            return 1;
        }
        print_item(argv[1], &ii);
    } else if (!strcmp(verb, "free")) {
        NARGS(2);
        if (!hvm_item_free(c, argv[1], argv[2], err)) {
            return 1;
        }
    } else if (!strcmp(verb, "stat") && argc == 1) {
        HvmPoolInfo pi;

        if (!hvm_pool_stat(c, &pi, err)) {
            return 1;
        }
        printf("capacity=%" G_GUINT64_FORMAT " used=%" G_GUINT64_FORMAT
               " free=%" G_GUINT64_FORMAT " quota=%" G_GUINT64_FORMAT
               " my_used=%" G_GUINT64_FORMAT " regions=%u conns=%u "
               "max_conns=%u align=%u item_align=%" G_GUINT64_FORMAT "\n",
               pi.capacity, pi.used,
               pi.capacity > pi.used ? pi.capacity - pi.used : 0, pi.quota,
               pi.caller_used, pi.nregions, pi.nconns, pi.max_conns, pi.align,
               pi.item_align);
    } else if (!strcmp(verb, "stat")) {
        GArray *items;

        NARGS(1);
        if (!hvm_region_stat(c, argv[1], &ri, &items, err)) {
            return 1;
        }
        print_region(&ri);
        for (guint i = 0; i < items->len; i++) {
            print_item(argv[1], &g_array_index(items, HvmItemInfo, i));
        }
        g_array_free(items, TRUE);
    } else if (!strcmp(verb, "list")) {
        GArray *regions;

        NARGS(0);
        if (!hvm_region_list(c, &regions, err)) {
            return 1;
        }
        for (guint i = 0; i < regions->len; i++) {
            print_region(&g_array_index(regions, HvmRegionInfo, i));
        }
        g_array_free(regions, TRUE);
    } else if (!strcmp(verb, "map")) {
        return map_and_run(c, argc, argv, err);
    } else if (!strcmp(verb, "podman-run")) {
        return hvm_podman_run(c, argc, argv, err);
    } else {
        goto bad;
    }
    return 0;
bad:
    fputs(usage, stderr);
    return 2;
#undef NARGS
}

int main(int argc, char **argv)
{
    const char *sock = hvm_default_socket();
    GError *err = NULL;
    HvmClient *c;
    int ret;

    argv++;
    argc--;
    if (argc >= 2 && (!strcmp(argv[0], "-s") || !strcmp(argv[0], "--socket"))) {
        sock = argv[1];
        argv += 2;
        argc -= 2;
    }
    if (argc < 1 || !strcmp(argv[0], "-h") || !strcmp(argv[0], "--help")) {
        fputs(usage, argc < 1 ? stderr : stdout);
        return argc < 1 ? 2 : 0;
    }
    if (!strcmp(argv[0], "psk")) {
        return hvm_psk_verb(argc, argv);    /* no broker on the client's host */
    }
    c = hvm_client_connect(sock, &err);
    if (!c) {
        fprintf(stderr, "hvmem: %s\n", err->message);
        g_error_free(err);
        return 1;
    }
    ret = run(c, argc, argv, &err);
    if (err) {
        fprintf(stderr, "hvmem: %s: %s (%s)\n", argv[0], err->message,
                g_strerror(err->code));
        g_error_free(err);
    }
    hvm_client_close(c);
    return ret;
}
