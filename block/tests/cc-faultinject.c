/*
 * Test-only fault injection for test_clone_cache.py (LD_PRELOAD into
 * qemu-storage-daemon; never linked into QEMU): while the file named by
 * $CC_FAULT_FLAG exists, a write to the file named by $CC_FAULT_FILE that
 * touches bytes [$CC_FAULT_LO, $CC_FAULT_HI) fails with EIO, as a failing
 * disk would make it.  The tests aim it at the slot records, to fail the
 * record writes of pinning and unpinning.  While the file named by
 * $CC_STALL_FLAG exists, every write to the cache file waits (the filler
 * stalls, its backlog stays full).  QEMU's thread pool writes with
 * pwrite() for one buffer and pwritev() for several.  The cache file is
 * written with io_uring where QEMU can, which no LD_PRELOAD sees: a seccomp
 * filter set up at load makes io_uring_setup() fail with ENOSYS, so that
 * QEMU falls back to its thread pool (as on a kernel without io_uring).
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* io_uring_setup() fails with ENOSYS in this process from now on */
static void __attribute__((constructor)) cc_no_io_uring(void)
{
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = { .len = sizeof(f) / sizeof(f[0]), .filter = f };

    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        perror("cc-faultinject: seccomp");
        abort();
    }
}

/* Whether @fd is the file named by $CC_FAULT_FILE */
static int cc_is_cache(int fd)
{
    const char *file = getenv("CC_FAULT_FILE");
    struct stat a, b;

    return file && fstat(fd, &a) == 0 && stat(file, &b) == 0 &&
           a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

static int cc_fault(int fd, off_t off, size_t len)
{
    const char *flag = getenv("CC_FAULT_FLAG");
    const char *lo = getenv("CC_FAULT_LO"), *hi = getenv("CC_FAULT_HI");

    if (!flag || !lo || !hi || access(flag, F_OK) != 0 || !cc_is_cache(fd)) {
        return 0;
    }
    return off < strtoll(hi, NULL, 0) && off + (off_t)len > strtoll(lo, NULL, 0);
}

/* While the file named by $CC_STALL_FLAG exists, a write to the cache waits */
static void cc_stall(int fd)
{
    const char *flag = getenv("CC_STALL_FLAG");

    while (flag && access(flag, F_OK) == 0 && cc_is_cache(fd)) {
        usleep(10000);
    }
}

ssize_t pwrite64(int fd, const void *buf, size_t len, off_t off)
{
    static ssize_t (*real)(int, const void *, size_t, off_t);

    if (!real) {
        real = (ssize_t (*)(int, const void *, size_t, off_t))
               dlsym(RTLD_NEXT, "pwrite64");
    }
    cc_stall(fd);
    if (cc_fault(fd, off, len)) {
        errno = EIO;
        return -1;
    }
    return real(fd, buf, len, off);
}

ssize_t pwritev64(int fd, const struct iovec *iov, int n, off_t off)
{
    static ssize_t (*real)(int, const struct iovec *, int, off_t);
    size_t len = 0;
    int i;

    if (!real) {
        real = (ssize_t (*)(int, const struct iovec *, int, off_t))
               dlsym(RTLD_NEXT, "pwritev64");
    }
    for (i = 0; i < n; i++) {
        len += iov[i].iov_len;
    }
    cc_stall(fd);
    if (cc_fault(fd, off, len)) {
        errno = EIO;
        return -1;
    }
    return real(fd, iov, n, off);
}
