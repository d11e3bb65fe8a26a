/* port.c -- the host port: RESP2 requests from the QEMU side over a
 * virtio-serial port (or a pty/unix socket in tests). */

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <termios.h>
#include <unistd.h>

#include "hybridmem.h"

/* The port speaks RESP2 (the host side uses hiredis 0.14, which has no
 * maps): a map is a flat array name, value, name, value... */
static int portRenderFields(RespBuf *b, const Fields *fs) {
    if (fs->err) return respAddError(b, fs->err);
    if (respAddMapLen(b, fs->n, 0) < 0) return -1;
    for (int i = 0; i < fs->n; i++) {
        if (respAddBulk(b, fs->f[i].name, strlen(fs->f[i].name)) < 0) return -1;
        if (fs->f[i].s) {
            if (respAddBulk(b, fs->f[i].s, strlen(fs->f[i].s)) < 0) return -1;
        } else if (respAddInt(b, fs->f[i].i) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ host port */

void hmPortClose(int retry);
void hmPortOpen(void);

static void portRetryTimer(RedisModuleCtx *ctx, void *data) {
    (void)ctx;
    (void)data;
    hm.port.timer_set = 0;
    hmPortOpen();
}

static void portScheduleRetry(void) {
    if (hm.port.timer_set) return;
    hm.port.timer = RedisModule_CreateTimer(hm.dctx, hm.cfg.port_retry_ms, portRetryTimer, NULL);
    hm.port.timer_set = 1;
}

static void portFlush(void);

static void portWritable(int fd, void *ud, int mask) {
    (void)fd;
    (void)ud;
    (void)mask;
    portFlush();
}

/* Write what we can; keep the rest and wait for the fd to be writable. */
static void portFlush(void) {
    while (hm.port.out.len) {
        ssize_t n = write(hm.port.fd, hm.port.out.p, hm.port.out.len);
        if (n > 0) {
            respBufConsume(&hm.port.out, (size_t)n);
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) {
            RedisModule_EventLoopAdd(hm.port.fd, REDISMODULE_EVENTLOOP_WRITABLE, portWritable, NULL);
            return;
        }
        hmPortClose(1);     /* host went away */
        return;
    }
    RedisModule_EventLoopDel(hm.port.fd, REDISMODULE_EVENTLOOP_WRITABLE);
}

static void portExecute(const RespRequest *req, RespBuf *out) {
    Fields fs = {0};
    const char *c = req->argv[0];
    size_t cl = req->argl[0];
    hm.port.requests++;
    if (req->argc == 1 && hmCmdIs(c, cl, "ping")) {
        respAddSimple(out, "PONG");
        return;
    }
    if (hmCmdIs(c, cl, "appassist.prepare") && req->argc <= 2) {
        long long deadline = 0;
        if (req->argc == 2) {
            char *end;
            errno = 0;
            deadline = strtoll(req->argv[1], &end, 10);
            if (req->argl[1] == 0 || *end || errno || deadline < 0 || deadline > 86400000LL) {
                respAddError(out, "ERR deadline-ms must be an integer between 0 and 86400000");
                hm.port.errors++;
                return;
            }
        }
        hmPrepareFields(hm.dctx, &fs, deadline, 1);
    } else if (hmCmdIs(c, cl, "appassist.pages") && req->argc == 2) {
        hmPagesReply(req->argv[1], req->argl[1], out);
        return;
    } else if (hmCmdIs(c, cl, "appassist.resume") && req->argc == 1) {
        hmResumeFields(hm.dctx, &fs, 0);
    } else if (hmCmdIs(c, cl, "appassist.abort") && req->argc == 1) {
        hmResumeFields(hm.dctx, &fs, 1);
    } else if (hmCmdIs(c, cl, "appassist.status") && req->argc == 1) {
        hmStatusFields(hm.dctx, &fs);
    } else {
        hm.port.errors++;
        respAddError(out, "ERR unknown command or wrong number of arguments on the appassist port");
        return;
    }
    portRenderFields(out, &fs);
}

static void portReadable(int fd, void *ud, int mask) {
    (void)ud;
    (void)mask;
    for (;;) {
        char tmp[HM_PORT_INBUF];
        ssize_t n = read(fd, tmp, sizeof(tmp));
        if (n == 0) { hmPortClose(1); return; }            /* EOF: host gone */
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN) { hmPortClose(1); return; }   /* EIO: pty master closed */
            /* Nothing to read. A virtio port whose host side is gone
             * reports POLLHUP; epoll would wake us forever. */
            struct pollfd p = {fd, POLLIN, 0};
            if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR)) && !(p.revents & POLLIN)) {
                hmPortClose(1);
                return;
            }
            hm.port.discarding = 0;
            break;
        }
        if (hm.port.discarding) continue;
        size_t off = 0;
        while (off < (size_t)n) {
            size_t take = sizeof(hm.port.in) - hm.port.inlen;
            if (take > (size_t)n - off) take = (size_t)n - off;
            memcpy(hm.port.in + hm.port.inlen, tmp + off, take);
            hm.port.inlen += take;
            off += take;
            for (;;) {
                static RespRequest req;
                size_t used = 0;
                const char *err = NULL;
                RespParse pr = respParseRequest(hm.port.in, hm.port.inlen, &req, &used, &err);
                if (pr == RESP_NEED_MORE) {
                    if (hm.port.inlen == sizeof(hm.port.in)) {
                        pr = RESP_ERROR;
                        err = "request too big";
                    } else {
                        break;
                    }
                }
                if (pr == RESP_ERROR) {
                    char msg[128];
                    snprintf(msg, sizeof(msg), "ERR Protocol error: %s", err);
                    hm.port.errors++;
                    respAddError(&hm.port.out, msg);
                    hm.port.inlen = 0;
                    hm.port.discarding = 1;     /* drop the rest of this burst */
                    off = (size_t)n;
                    break;
                }
                memmove(hm.port.in, hm.port.in + used, hm.port.inlen - used);
                hm.port.inlen -= used;
                if (req.argc > 0) portExecute(&req, &hm.port.out);
            }
        }
        if (hm.port.fd < 0) return;
    }
    if (hm.port.fd >= 0 && hm.port.out.len) portFlush();
}

void hmPortClose(int retry) {
    if (hm.port.fd >= 0) {
        RedisModule_EventLoopDel(hm.port.fd, REDISMODULE_EVENTLOOP_READABLE | REDISMODULE_EVENTLOOP_WRITABLE);
        close(hm.port.fd);
        hm.port.fd = -1;
    }
    hm.port.inlen = 0;
    hm.port.discarding = 0;
    hm.port.out.len = 0;
    if (retry) portScheduleRetry();
}

/* appassist.port-path changed: close the port, and open the new one. */
void hmPortRestart(void) {
    hmPortClose(0);
    if (hm.port.timer_set) {
        RedisModule_StopTimer(hm.dctx, hm.port.timer, NULL);
        hm.port.timer_set = 0;
    }
    hmPortOpen();
}

/* Open the configured port. A missing device is not an error: retry later. */
void hmPortOpen(void) {
    if (hm.port.fd >= 0) return;
    size_t pl;
    const char *p = RedisModule_StringPtrLen(hm.cfg.port_path, &pl);
    if (pl == 0) return;                     /* disabled */
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%.*s", (int)pl, p);
    struct stat st;
    int fd = -1;
    if (stat(path, &st) == 0 && S_ISSOCK(st.st_mode)) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        if (strlen(path) < sizeof(sa.sun_path)) {
            strcpy(sa.sun_path, path);
            fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                close(fd);
                fd = -1;
            }
        }
    } else {
        fd = open(path, O_RDWR | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (fd >= 0 && isatty(fd)) {
            struct termios t;
            if (tcgetattr(fd, &t) == 0) {
                cfmakeraw(&t);
                tcsetattr(fd, TCSANOW, &t);
            }
        }
    }
    if (fd < 0) {
        portScheduleRetry();
        return;
    }
    hm.port.fd = fd;
    hm.port.opens++;
    if (RedisModule_EventLoopAdd(fd, REDISMODULE_EVENTLOOP_READABLE, portReadable, NULL) != REDISMODULE_OK) {
        RedisModule_Log(hm.dctx, "warning", "appassist: cannot watch port %s: %s", path, strerror(errno));
        hmPortClose(1);
        return;
    }
    /* A virtio port without a host reads EOF at once and is retried every
     * port-retry-ms: only the first open is worth a notice. */
    RedisModule_Log(hm.dctx, hm.port.opens == 1 ? "notice" : "verbose",
                    "appassist: port %s open", path);
}
