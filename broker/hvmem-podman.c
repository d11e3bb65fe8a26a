/*
 * hvmem podman-run: a podman container with a broker region inside.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 *   hvmem podman-run NAME [--rw] -- PODMAN [GLOBAL-OPTIONS] run [RUN-OPTIONS]
 *       IMAGE [ARGS]
 *
 * The broker decides who may have the region; podman (rootful, runc) runs
 * the container; hvmem holds the region for exactly the container's life:
 *
 *  1. map the region with the caller's credentials: an O_RDONLY descriptor,
 *     or O_RDWR and the region's single read-write lease with --rw;
 *  2. name its file.  runc cannot bind-mount /proc/PID/fd/N: the file's
 *     mount belongs to the host's mount namespace, runc mounts in the
 *     container's copy of it, and the kernel refuses a bind from another
 *     namespace (EINVAL).  So the source is the file's path in the pool (a
 *     0700 directory of the broker's), checked to be the descriptor's
 *     inode, through a link that lives only as long as hvmem (make_link());
 *  3. fork the guard (guard() below);
 *  4. `podman create --rm --mount type=bind,src=FILE,dst=/run/hvmem/NAME[,ro]
 *     --env HVMEM_REGION_PATH=/run/hvmem/NAME --env HVMEM_SIZE=N RUN-OPTIONS`;
 *  5. judge the container before anything in it runs (prepare()): not
 *     --privileged, then `podman init` -- runc makes its namespaces and
 *     mounts, sets its capabilities and stops before its command -- and
 *     check_process() on what runc made, from /proc/PID: podman's options
 *     and containers.conf are too many to judge from the command line, and
 *     podman 4.3's inspect says "shareable" for --ipc=host;
 *  6. `podman start --attach CID`: the container runs, its status is ours;
 *  7. `podman rm -f CID` -- a container on a region never runs again (a
 *     later start would mount a file nobody holds for it) -- and only then
 *     let go of the descriptor and the lease.
 *
 * Read-only is a read-only bind mount (MS_RDONLY), which the container's
 * root cannot remount without CAP_SYS_ADMIN: so a read-only container with
 * that capability is refused.  The pool's other files are out of reach
 * because only the region's file is mounted: a container with another
 * mount that leads to the pool (--ipc=host brings the host's /dev/shm),
 * or the host's pid namespace (/proc/PID/root), is refused.
 *
 * Never a shell: every podman command is an argv.  The options are the
 * caller's (who, running rootful podman, is root anyway); what is checked
 * is what the container's processes get.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hvmem-podman.h"

#define MOUNT_DIR       "/run/hvmem"
#define LINK_DIR        "/run/hvmem-podman-XXXXXX"
#define CID_LEN         64              /* podman's container ids: hex */
#define CREATE_OUT_MAX  4096            /* podman create prints the id */
#define INSPECT_OUT_MAX 4096            /* one short line */

/*
 * podman's global options (podman 4.3) that may come before "run", and
 * whether each takes a value.  The rest are refused: --remote, --url,
 * --connection, --identity and --ssh run the container on another machine
 * (where the region's file is not), --noout hides the container's id.
 */
static const struct {
    const char *name;
    bool value;
} podman_globals[] = {
    { "--root", true },             { "--runroot", true },
    { "--runtime", true },          { "--runtime-flag", true },
    { "--cgroup-manager", true },   { "--events-backend", true },
    { "--conmon", true },           { "--hooks-dir", true },
    { "--log-level", true },        { "--namespace", true },
    { "--network-cmd-path", true }, { "--network-config-dir", true },
    { "--storage-driver", true },   { "--storage-opt", true },
    { "--tmpdir", true },           { "--volumepath", true },
    { "--syslog", false },
};

typedef struct PodmanRun {
    const char *name;           /* the region */
    bool rw;
    GPtrArray *podman;          /* PODMAN and its global options */
    char **run_args;            /* what followed "run" */
    int nrun_args;
    char *file;                 /* the region's file in the pool */
    dev_t dev;                  /* the pool's file system */
    char *link_dir;             /* private: holds link, made by make_link() */
    char *link;                 /* link_dir/NAME -> file: the mount's source */
    char *dst;                  /* MOUNT_DIR/NAME */
    char cid[CID_LEN + 1];      /* empty until created */
} PodmanRun;

static const char usage_line[] =
    "usage: hvmem [-s SOCKET] podman-run NAME [--rw] -- PODMAN [OPTIONS] run "
    "[RUN-OPTIONS] IMAGE [ARGS]\n";

static void refuse(const char *fmt, ...) G_GNUC_PRINTF(1, 2);

static void refuse(const char *fmt, ...)
{
    va_list ap;

    fputs("hvmem: podman-run: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/*
 * A region in a container is a file name in podman's --mount option, which
 * podman splits at commas and reads quotes in: a conservative alphabet.
 */
static bool name_ok(const char *name)
{
    size_t len = strlen(name);

    return len >= 1 && len <= HVM_NAME_MAX &&
           strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                        "0123456789._+@:-") == len &&
           strcmp(name, ".") && strcmp(name, "..") && !strstr(name, "..");
}

/* Where "run" is in PODMAN [OPTIONS] run ...: -1 (after a message) if not. */
static int find_run(char **argv, int argc)
{
    for (int i = 1; i < argc; i++) {
        const char *eq = strchr(argv[i], '=');
        size_t len = eq ? (size_t)(eq - argv[i]) : strlen(argv[i]);
        size_t k;

        if (!strcmp(argv[i], "run")) {
            return i;
        }
        if (argv[i][0] != '-') {
            refuse("'%s' is not podman's run command (PODMAN [OPTIONS] run ...)",
                   argv[i]);
            return -1;
        }
        for (k = 0; k < G_N_ELEMENTS(podman_globals); k++) {
            if (strlen(podman_globals[k].name) == len &&
                !strncmp(podman_globals[k].name, argv[i], len)) {
                break;
            }
        }
        if (k == G_N_ELEMENTS(podman_globals)) {
            refuse("podman option %.*s is not supported here (a container on "
                   "a region runs on this host, by this podman)", (int)len,
                   argv[i]);
            return -1;
        }
        if (podman_globals[k].value && !eq && ++i == argc) {
            refuse("podman option %s needs a value", argv[i - 1]);
            return -1;
        }
        if (!podman_globals[k].value && eq) {
            refuse("podman option %.*s takes no value", (int)len, argv[i]);
            return -1;
        }
    }
    refuse("no run command after podman's options");
    return -1;
}

static int parse_args(int argc, char **argv, PodmanRun *pr)
{
    int i = 2, run;

    if (argc < 2) {
        fputs(usage_line, stderr);
        return 2;
    }
    pr->name = argv[1];
    if (argc > i && !strcmp(argv[i], "--rw")) {
        pr->rw = true;
        i++;
    }
    if (argc < i + 2 || strcmp(argv[i], "--")) {
        fputs(usage_line, stderr);
        return 2;
    }
    if (!name_ok(pr->name)) {
        refuse("bad region name '%s' for a container (1 to %d of A-Z a-z 0-9 "
               "._+@:- and no '..')", pr->name, HVM_NAME_MAX);
        return 2;
    }
    argv += i + 1;
    argc -= i + 1;
    run = find_run(argv, argc);
    if (run < 0) {
        return 2;
    }
    pr->podman = g_ptr_array_new();
    for (i = 0; i < run; i++) {
        g_ptr_array_add(pr->podman, argv[i]);
    }
    pr->run_args = argv + run + 1;
    pr->nrun_args = argc - run - 1;
    pr->dst = g_strdup_printf(MOUNT_DIR "/%s", pr->name);
    return 0;
}

/*
 * The region's file by path (see 2. above) and its file system.  The path must
 * lead to the descriptor's inode from here (it would not if the broker ran
 * in another mount namespace), and hold nothing --mount cannot carry.
 */
static bool region_file(PodmanRun *pr, int fd)
{
    g_autofree char *proc = g_strdup_printf("/proc/self/fd/%d", fd);
    char link[PATH_MAX];
    struct stat a, b;
    ssize_t n;

    n = readlink(proc, link, sizeof(link) - 1);
    if (n < 0) {
        refuse("cannot read %s: %s", proc, g_strerror(errno));
        return false;
    }
    link[n] = 0;
    if (link[0] == '/' && stat(link, &b) < 0) {
        refuse("cannot reach the region's file %s: %s (the pool is the "
               "broker's: podman-run needs root, as rootful podman does)",
               link, g_strerror(errno));
        return false;
    }
    if (fstat(fd, &a) < 0 || link[0] != '/' ||
        a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
        refuse("the region's file is not %s from here (is the broker in "
               "another mount namespace?)", link);
        return false;
    }
    for (const char *p = link; *p; p++) {
        if (*p == ',' || *p == '"' || (unsigned char)*p < 0x20 || *p == 0x7f) {
            refuse("the region's file %s has a character podman's --mount "
                   "cannot carry (the pool's path)", link);
            return false;
        }
    }
    pr->file = g_strdup(link);
    pr->dev = a.st_dev;
    return true;
}

/*
 * The mount's source: a symbolic link to the region's file in a private
 * directory that lives only as long as hvmem or its guard, so that a
 * container they leave behind can never start (runc would not find it).
 */
static bool make_link(PodmanRun *pr)
{
    char tmpl[] = LINK_DIR;

    if (!mkdtemp(tmpl)) {
        refuse("cannot make a directory %s: %s", tmpl, g_strerror(errno));
        return false;
    }
    pr->link_dir = g_strdup(tmpl);
    pr->link = g_strdup_printf("%s/%s", tmpl, pr->name);
    if (symlink(pr->file, pr->link) < 0) {
        refuse("cannot make %s: %s", pr->link, g_strerror(errno));
        return false;
    }
    return true;
}

static void drop_link(PodmanRun *pr)
{
    if (pr->link_dir) {
        unlink(pr->link);
        rmdir(pr->link_dir);
    }
}

/*
 * PODMAN [OPTIONS] VERB ARGS... (the strings are borrowed); the caller may
 * add more, then ends it with NULL for spawn() and frees it.
 */
static GPtrArray *podman_cmd(PodmanRun *pr, const char *verb, ...)
{
    GPtrArray *a = g_ptr_array_new();
    const char *s;
    va_list ap;

    for (guint i = 0; i < pr->podman->len; i++) {
        g_ptr_array_add(a, pr->podman->pdata[i]);
    }
    g_ptr_array_add(a, (char *)verb);
    va_start(ap, verb);
    while ((s = va_arg(ap, const char *))) {
        g_ptr_array_add(a, (char *)s);
    }
    va_end(ap);
    return a;
}

/*
 * Runs @argv (a NULL-terminated array; never a shell) with its stdout on
 * @out and its stderr on @err (-1: ours).  Returns its pid or -1.
 */
static pid_t spawn(GPtrArray *argv, int out, int err)
{
    char **args = (char **)argv->pdata;
    pid_t pid;

    g_assert(argv->len && !argv->pdata[argv->len - 1]);
    pid = fork();
    if (pid < 0) {
        refuse("fork: %s", g_strerror(errno));
        return -1;
    }
    if (pid == 0) {
        /* ignored signals stay ignored across exec: podman gets its own */
        signal(SIGINT, SIG_DFL);
        signal(SIGQUIT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGHUP, SIG_DFL);
        signal(SIGPIPE, SIG_DFL);
        if ((out >= 0 && dup2(out, STDOUT_FILENO) < 0) ||
            (err >= 0 && dup2(err, STDERR_FILENO) < 0)) {
            _exit(127);
        }
        execvp(args[0], args);
        fprintf(stderr, "hvmem: podman-run: cannot run %s: %s\n", args[0],
                g_strerror(errno));
        _exit(127);
    }
    return pid;
}

/* @pid's exit status as a shell shows it (128 + N when killed by N). */
static int wait_status(pid_t pid)
{
    int status;

    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {
            refuse("waitpid: %s", g_strerror(errno));
            return 1;
        }
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/*
 * Runs @argv with its stdout read into *@out (NUL-terminated, at most @max
 * bytes).  Returns its exit status, with *@out NULL when it could not run
 * or printed more than @max bytes or a NUL (then non-zero).
 */
static int capture(GPtrArray *argv, size_t max, char **out)
{
    GString *s = g_string_new(NULL);
    bool bad = false;
    char buf[4096];
    int p[2], status;
    pid_t pid;

    *out = NULL;
    if (pipe2(p, O_CLOEXEC) < 0) {
        refuse("pipe: %s", g_strerror(errno));
        g_string_free(s, TRUE);
        return 1;
    }
    pid = spawn(argv, p[1], -1);
    close(p[1]);
    while (pid > 0) {
        ssize_t n = read(p[0], buf, sizeof(buf));

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            break;
        }
        if (s->len + n > max || memchr(buf, 0, n)) {
            bad = true;             /* read on, so that podman can finish */
        } else {
            g_string_append_len(s, buf, n);
        }
    }
    close(p[0]);
    status = pid > 0 ? wait_status(pid) : 1;
    if (bad) {
        refuse("%s printed more than %zu bytes, or a NUL",
               (char *)argv->pdata[0], max);
    }
    if (bad || status) {
        g_string_free(s, TRUE);
        return status ? status : 1;
    }
    *out = g_string_free(s, FALSE);
    return 0;
}

/* Decodes /proc/PID/mountinfo's octal escapes ("\040" a space) in place. */
static void unescape(char *s)
{
    char *d = s;

    for (; *s; s++) {
        if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' &&
            s[2] <= '7' && s[3] >= '0' && s[3] <= '7') {
            *d++ = (s[1] - '0') << 6 | (s[2] - '0') << 3 | (s[3] - '0');
            s += 3;
        } else {
            *d++ = *s;
        }
    }
    *d = 0;
}

/* Whether the path @r (of a file system) is @q, above it or in it. */
static bool path_meets(const char *r, const char *q)
{
    size_t rl = strlen(r), ql = strlen(q);

    if (!strcmp(r, "/") || !strcmp(q, "/")) {
        return true;
    }
    if (rl <= ql) {
        return !strncmp(q, r, rl) && (q[rl] == '/' || !q[rl]);
    }
    return !strncmp(r, q, ql) && r[ql] == '/';
}

static bool has_option(const char *opts, const char *opt)
{
    g_auto(GStrv) v = g_strsplit(opts, ",", -1);

    return g_strv_contains((const char *const *)v, opt);
}

/*
 * The container's mount table (runc has made every mount, nothing has run
 * yet): the region's mount must be there once, on the region's file
 * system (@dev), of a file named as the region's (pr->file), read-only
 * unless --rw; and no other mount of that file system may lead to the
 * pool -- the pool's directory, any directory above it, anything in it.
 * The pool's path on its file system is that of the region's mount's
 * directory.  Returns 0, or 2 after saying why not.
 */
static int check_mounts(PodmanRun *pr, int pid, dev_t dev)
{
    g_autofree char *path = g_strdup_printf("/proc/%d/mountinfo", pid);
    g_autofree char *text = NULL;
    g_autofree char *base = g_path_get_basename(pr->file);
    g_autofree char *pool = NULL;
    g_auto(GStrv) lines = NULL;
    GError *err = NULL;
    int pass;

    if (!g_file_get_contents(path, &text, NULL, &err)) {
        refuse("%s", err->message);
        g_error_free(err);
        return 2;
    }
    lines = g_strsplit(text, "\n", -1);
    /* pass 0 finds the region's mount, pass 1 judges the others */
    for (pass = 0; pass < 2; pass++) {
        for (char **l = lines; *l; l++) {
            g_auto(GStrv) f = g_strsplit(*l, " ", 7);
            unsigned maj, min;
            char end;
            bool same;

            if (!**l) {
                continue;
            }
            if (g_strv_length(f) < 7 ||
                sscanf(f[2], "%u:%u%c", &maj, &min, &end) != 2) {
                refuse("%s: cannot read '%.80s'", path, *l);
                return 2;
            }
            unescape(f[3]);
            unescape(f[4]);
            same = makedev(maj, min) == dev;
            if (pass == 0 && !strcmp(f[4], pr->dst)) {
                g_autofree char *name = g_path_get_basename(f[3]);

                if (pool || !same || strcmp(name, base) ||
                    !has_option(f[5], pr->rw ? "rw" : "ro")) {
                    refuse("the container's mount at %s is not the region's "
                           "%s mount of %s", pr->dst,
                           pr->rw ? "read-write" : "read-only", pr->file);
                    return 2;
                }
                pool = g_path_get_dirname(f[3]);
            } else if (pass == 1 && same && strcmp(f[4], pr->dst) &&
                       path_meets(f[3], pool)) {
                refuse("the container's mount at %s leads to the broker's "
                       "pool (%s on its file system)", f[4], pool);
                return 2;
            }
        }
        if (!pool) {
            refuse("podman made no mount of the region at %s", pr->dst);
            return 2;
        }
    }
    return 0;
}

/*
 * The container's first process, as runc left it before its command (its
 * mounts made, capabilities set): its own pid namespace (/proc/PID/root
 * of a host process would lead to the pool), no CAP_SYS_ADMIN in any set
 * when read-only (it could remount the region read-write), the mounts of
 * check_mounts().  Returns 0, or 2 after saying why not.
 */
static int check_process(PodmanRun *pr, int pid, dev_t dev)
{
    g_autofree char *ns_path = g_strdup_printf("/proc/%d/ns/pid", pid);
    g_autofree char *status_path = g_strdup_printf("/proc/%d/status", pid);
    g_autofree char *status = NULL;
    char ns[64], own[64];
    ssize_t n, m;

    n = readlink(ns_path, ns, sizeof(ns) - 1);
    if (n < 0) {
        refuse("cannot read %s: %s", ns_path, g_strerror(errno));
        return 2;
    }
    m = readlink("/proc/self/ns/pid", own, sizeof(own) - 1);
    if (m < 0) {
        refuse("cannot read /proc/self/ns/pid: %s", g_strerror(errno));
        return 2;
    }
    ns[n] = own[m] = 0;
    if (!strcmp(ns, own)) {
        refuse("the container shares the host's pid namespace (--pid): "
               "/proc/PID/root of a host process leads to the pool");
        return 2;
    }
    if (!g_file_get_contents(status_path, &status, NULL, NULL)) {
        refuse("cannot read %s", status_path);
        return 2;
    }
    for (const char *p = status; !pr->rw && (p = strstr(p, "\nCap")); p++) {
        unsigned long long caps;

        if (sscanf(p, "\nCap%*3s:\t%llx", &caps) == 1 &&
            caps & (1ull << 21)) {              /* CAP_SYS_ADMIN */
            refuse("the container has CAP_SYS_ADMIN: it could remount the "
                   "read-only region read-write (give hvmem --rw if it is "
                   "to write)");
            return 2;
        }
    }
    return check_mounts(pr, pid, dev);
}

/*
 * podman create with the region's mount and variables before the caller's
 * run options (podman lets a later option win, so nothing here limits
 * them: prepare() judges what they made).
 * Returns 0 with pr->cid set, or podman's status (its message on stderr).
 */
static int create(PodmanRun *pr, uint64_t size)
{
    g_autofree char *mount = g_strdup_printf("type=bind,src=%s,dst=%s%s",
                                             pr->link, pr->dst,
                                             pr->rw ? "" : ",ro");
    g_autofree char *path_env = g_strdup_printf("HVMEM_REGION_PATH=%s", pr->dst);
    g_autofree char *size_env = g_strdup_printf("HVMEM_SIZE=%" G_GUINT64_FORMAT,
                                                size);
    g_autofree char *out = NULL;
    GPtrArray *a;
    const char *id;
    int status;

    a = podman_cmd(pr, "create", "--rm", "--mount", mount, "--env", path_env,
                   "--env", size_env, NULL);
    for (int i = 0; i < pr->nrun_args; i++) {
        g_ptr_array_add(a, pr->run_args[i]);
    }
    g_ptr_array_add(a, NULL);
    status = capture(a, CREATE_OUT_MAX, &out);
    g_ptr_array_free(a, TRUE);
    if (status) {
        return status;
    }
    g_strchomp(out);
    id = strrchr(out, '\n') ? strrchr(out, '\n') + 1 : out;    /* the last line */
    if (strlen(id) != CID_LEN || strspn(id, "0123456789abcdef") != CID_LEN) {
        refuse("podman create printed no container id: '%.80s'", id);
        return 1;
    }
    memcpy(pr->cid, id, CID_LEN + 1);
    return 0;
}

/*
 * podman rm -f: when it returns 0, the container is gone (or was).  Quiet
 * on stdout (podman prints the id), and on stderr too when @quiet.
 */
static int remove_container(PodmanRun *pr, bool quiet)
{
    int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
    GPtrArray *a = podman_cmd(pr, "rm", "--force", "--ignore", "--volumes",
                              "--time", "0", pr->cid, NULL);
    pid_t pid;
    int status = 1;

    g_ptr_array_add(a, NULL);
    pid = spawn(a, null, quiet ? null : -1);
    if (pid > 0) {
        status = wait_status(pid);
    }
    if (null >= 0) {
        close(null);
    }
    g_ptr_array_free(a, TRUE);
    return status;
}

/* A message to the guard: "C<id>\n" or "D\n" (see guard()). */
static void tell_guard(int sock, const char *msg)
{
    size_t len = strlen(msg);

    while (send(sock, msg, len, MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
}

/*
 * The guard, a child forked once the region is mapped: it holds copies of
 * the broker connection (so the lease) and of the region's descriptor, and
 * if hvmem goes away before it has removed the container, removes it and
 * only then lets go of them.  So the region is held for exactly the
 * container's life even when hvmem is killed.  hvmem tells it on @sock:
 * "C<id>\n" once the container exists, "D\n" once it has cleaned up; EOF
 * without "D" is hvmem's death.  A container hvmem made but could not name
 * (killed while podman create ran) is left, but cannot start: the guard
 * removes its mount's source, make_link().  It has its own session and ignores the terminal's
 * and the termination signals: ^C, or a SIGTERM to hvmem's process group,
 * must not take it down before it has cleaned up (SIGKILL still does).
 */
static G_GNUC_NORETURN void guard(PodmanRun *pr, int sock)
{
    char buf[CID_LEN + 8];
    size_t len = 0;
    ssize_t n;

    setsid();
    signal(SIGINT, SIG_IGN);
    signal(SIGQUIT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    while (len < sizeof(buf) && (n = read(sock, buf + len, sizeof(buf) - len))) {
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            break;
        }
        len += n;
    }
    if (len >= 2 && buf[len - 2] == 'D' && buf[len - 1] == '\n') {
        _exit(0);                       /* hvmem has cleaned up */
    }
    if (len >= CID_LEN + 2 && buf[0] == 'C' && buf[CID_LEN + 1] == '\n') {
        memcpy(pr->cid, buf + 1, CID_LEN);
        pr->cid[CID_LEN] = 0;
        fprintf(stderr, "hvmem: podman-run: hvmem went away; removing "
                "container %.12s\n", pr->cid);
        if (remove_container(pr, true)) {
            fprintf(stderr, "hvmem: podman-run: could not remove container "
                    "%.12s\n", pr->cid);
        }
    }
    drop_link(pr);
    _exit(0);
}

/*
 * podman inspect CID --format FORMAT: its one line, or NULL (after a
 * message) when podman failed.
 */
static char *inspect(PodmanRun *pr, const char *format)
{
    GPtrArray *a = podman_cmd(pr, "inspect", "--type", "container", "--format",
                              format, pr->cid, NULL);
    char *out;

    g_ptr_array_add(a, NULL);
    if (capture(a, INSPECT_OUT_MAX, &out)) {
        refuse("podman inspect %.12s failed", pr->cid);
        out = NULL;
    } else {
        g_strchomp(out);
    }
    g_ptr_array_free(a, TRUE);
    return out;
}

/*
 * Gets the created container ready to start and judges it: not
 * privileged, then `podman init` (runc makes its namespaces and mounts
 * and stops before its command) and check_process() on what runc made.
 * Returns 0, podman's status when it failed, or 2 when the container is
 * refused.  *@interactive: it was created with -i.
 */
static int prepare(PodmanRun *pr, bool *interactive)
{
    g_autofree char *conf = inspect(pr, "{{.HostConfig.Privileged}} "
                                        "{{.Config.OpenStdin}}");
    g_autofree char *pid = NULL;
    int null, status = 1;
    char *end;
    long n;
    GPtrArray *a;
    pid_t p;

    if (!conf) {
        return 1;
    }
    if (!strcmp(conf, "true false") || !strcmp(conf, "true true")) {
        refuse("the container is privileged (--privileged): it has the "
               "host's devices and every capability, whatever the region's "
               "mount says");
        return 2;
    }
    if (strcmp(conf, "false false") && strcmp(conf, "false true")) {
        refuse("podman inspect %.12s: unexpected '%.80s'", pr->cid, conf);
        return 1;
    }
    *interactive = !strcmp(conf, "false true");

    null = open("/dev/null", O_WRONLY | O_CLOEXEC);
    a = podman_cmd(pr, "init", pr->cid, NULL);
    g_ptr_array_add(a, NULL);
    p = spawn(a, null, -1);
    if (p > 0) {
        status = wait_status(p);
    }
    g_ptr_array_free(a, TRUE);
    if (null >= 0) {
        close(null);
    }
    if (status) {
        return status;
    }
    pid = inspect(pr, "{{.State.Pid}}");
    if (!pid) {
        return 1;
    }
    errno = 0;
    n = strtol(pid, &end, 10);
    if (errno || *end || n <= 1 || n > INT_MAX) {
        refuse("podman inspect %.12s: no process ('%.80s')", pr->cid, pid);
        return 1;
    }
    return check_process(pr, n, pr->dev);
}

int hvm_podman_run(HvmClient *c, int argc, char **argv, GError **errp)
{
    PodmanRun pr = { 0 };
    g_autofree char *msg = NULL;
    bool interactive = false;
    int fd = -1, sv[2] = { -1, -1 }, ret;
    pid_t guard_pid = -1, pid;
    HvmRegionInfo ri;
    GPtrArray *a;

    ret = parse_args(argc, argv, &pr);
    if (ret) {
        goto out;
    }
    fd = hvm_region_map(c, pr.name, pr.rw, &ri, errp);
    if (fd < 0) {
        ret = 1;
        goto out;
    }
    ret = 1;
    if (!region_file(&pr, fd) || !make_link(&pr)) {
        goto out;
    }
    /*
     * As system(3) does while its command runs: the terminal's ^C and ^\
     * are the container's (podman start --attach proxies them to it).
     */
    signal(SIGINT, SIG_IGN);
    signal(SIGQUIT, SIG_IGN);
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
        refuse("socketpair: %s", g_strerror(errno));
        goto out;
    }
    guard_pid = fork();
    if (guard_pid < 0) {
        refuse("fork: %s", g_strerror(errno));
        goto out;
    }
    if (guard_pid == 0) {
        close(sv[0]);
        guard(&pr, sv[1]);
    }
    close(sv[1]);
    ret = create(&pr, ri.size);
    if (ret) {
        goto out;
    }
    msg = g_strdup_printf("C%s\n", pr.cid);
    tell_guard(sv[0], msg);

    ret = prepare(&pr, &interactive);
    if (!ret) {
        a = interactive ?
            podman_cmd(&pr, "start", "--attach", "--interactive", pr.cid, NULL) :
            podman_cmd(&pr, "start", "--attach", pr.cid, NULL);
        g_ptr_array_add(a, NULL);
        pid = spawn(a, -1, -1);
        ret = pid > 0 ? wait_status(pid) : 1;
        g_ptr_array_free(a, TRUE);
    }
    if (remove_container(&pr, false)) {
        refuse("could not remove container %.12s (podman rm failed)", pr.cid);
    }
out:
    drop_link(&pr);
    if (guard_pid > 0) {
        tell_guard(sv[0], "D\n");
        close(sv[0]);
        wait_status(guard_pid);
    } else if (sv[0] >= 0) {
        close(sv[0]);
        close(sv[1]);
    }
    if (fd >= 0) {
        close(fd);
    }
    if (pr.podman) {
        g_ptr_array_free(pr.podman, TRUE);
    }
    g_free(pr.file);
    g_free(pr.link_dir);
    g_free(pr.link);
    g_free(pr.dst);
    return ret;
}
