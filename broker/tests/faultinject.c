/*
 * Test-only fault injection for the broker's Python tests (LD_PRELOAD; never
 * linked into hvmemd): while the file named by $HVMEM_FAULT_DIRSYNC exists,
 * fsync() of a directory fails with EIO, as a failing disk would make it.
 * test_durability.py uses it to fail the catalogue commit's last step, the
 * directory fsync after rename().
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

int fsync(int fd)
{
    static int (*real_fsync)(int);
    const char *flag = getenv("HVMEM_FAULT_DIRSYNC");
    struct stat st;

    if (!real_fsync) {
        real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    }
    if (flag && access(flag, F_OK) == 0 && fstat(fd, &st) == 0 &&
        S_ISDIR(st.st_mode)) {
        errno = EIO;
        return -1;
    }
    return real_fsync(fd);
}
