/*
 * hvmem broker wire protocol: encoder and decoder (see proto.h).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "proto.h"

void hvm_reader_init(HvmReader *r, const void *p, size_t len)
{
    r->p = p;
    r->len = len;
    r->off = 0;
    r->err = false;
}

const uint8_t *hvm_get_bytes(HvmReader *r, size_t n)
{
    const uint8_t *p;

    if (r->err || n > r->len - r->off) {
        r->err = true;
        return NULL;
    }
    p = r->p + r->off;
    r->off += n;
    return p;
}

uint16_t hvm_get_u16(HvmReader *r)
{
    const uint8_t *p = hvm_get_bytes(r, 2);

    return p ? (uint16_t)(p[0] | p[1] << 8) : 0;
}

uint32_t hvm_get_u32(HvmReader *r)
{
    const uint8_t *p = hvm_get_bytes(r, 4);

    return p ? (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
               (uint32_t)p[3] << 24 : 0;
}

uint64_t hvm_get_u64(HvmReader *r)
{
    uint64_t lo = hvm_get_u32(r);
    uint64_t hi = hvm_get_u32(r);

    return lo | hi << 32;
}

void hvm_put_u16(GByteArray *b, uint16_t v)
{
    uint8_t p[2] = { v, v >> 8 };

    g_byte_array_append(b, p, 2);
}

void hvm_put_u32(GByteArray *b, uint32_t v)
{
    uint8_t p[4] = { v, v >> 8, v >> 16, v >> 24 };

    g_byte_array_append(b, p, 4);
}

void hvm_put_u64(GByteArray *b, uint64_t v)
{
    hvm_put_u32(b, (uint32_t)v);
    hvm_put_u32(b, (uint32_t)(v >> 32));
}

static const char *const op_names[HVM_OP__MAX] = {
    [HVM_OP_CREATE] = "create",
    [HVM_OP_LOOKUP] = "lookup",
    [HVM_OP_DESTROY] = "destroy",
    [HVM_OP_RESIZE] = "resize",
    [HVM_OP_ALLOC] = "alloc",
    [HVM_OP_ITEM_LOOKUP] = "item-lookup",
    [HVM_OP_FREE] = "free",
    [HVM_OP_CHMOD] = "chmod",
    [HVM_OP_STAT] = "stat",
    [HVM_OP_LIST] = "list",
    [HVM_OP_MAP] = "map",
    [HVM_OP_RELEASE] = "release",
    [HVM_OP_EXPORT_KEYS] = "export-keys",
};

const char *hvm_op_name(unsigned op)
{
    return op > 0 && op < HVM_OP__MAX ? op_names[op] : "unknown";
}

/* Which request fields an op takes: anything else must be zero or empty. */
enum {
    F_NAME = 1,         /* a region name is required */
    F_NAME_OPT = 2,     /* a region name may be given */
    F_ITEM = 4,
    F_SIZE = 8,
    F_MODE = 16,
    F_MAPFLAGS = 32,
};

static const unsigned op_fields[HVM_OP__MAX] = {
    [HVM_OP_CREATE] = F_NAME | F_SIZE | F_MODE,
    [HVM_OP_LOOKUP] = F_NAME,
    [HVM_OP_DESTROY] = F_NAME,
    [HVM_OP_RESIZE] = F_NAME | F_SIZE,
    [HVM_OP_ALLOC] = F_NAME | F_ITEM | F_SIZE,
    [HVM_OP_ITEM_LOOKUP] = F_NAME | F_ITEM,
    [HVM_OP_FREE] = F_NAME | F_ITEM,
    [HVM_OP_CHMOD] = F_NAME | F_MODE,
    [HVM_OP_STAT] = F_NAME_OPT,
    [HVM_OP_LIST] = 0,
    [HVM_OP_MAP] = F_NAME | F_MAPFLAGS,
    [HVM_OP_RELEASE] = F_NAME,
    [HVM_OP_EXPORT_KEYS] = F_NAME | F_MAPFLAGS,
};

const char *hvm_name_check(const char *name, size_t len)
{
    if (len == 0) {
        return "empty name";
    }
    if (len > HVM_NAME_MAX) {
        return "name longer than 255 bytes";
    }
    for (size_t i = 0; i < len; i++) {
        unsigned char c = name[i];

        if (c == '/') {
            return "name contains '/'";
        }
        if (c < 0x21 || c > 0x7e) {
            return "name contains a byte that is not printable ASCII (or a space)";
        }
        if (c == '.' && i + 1 < len && name[i + 1] == '.') {
            return "name contains '..'";
        }
    }
    if (len == 1 && name[0] == '.') {
        return "name is '.'";
    }
    return NULL;
}

int hvm_header_decode(const uint8_t *buf, HvmHeader *h, bool reply,
                      const char **why)
{
    HvmReader r;
    uint32_t max = reply ? HVM_MAX_REPLY_BODY : HVM_MAX_REQ_BODY;

    hvm_reader_init(&r, buf, HVM_HDR_SIZE);
    h->magic = hvm_get_u32(&r);
    h->version = hvm_get_u16(&r);
    h->op = hvm_get_u16(&r);
    h->length = hvm_get_u32(&r);
    h->seq = hvm_get_u32(&r);
    if (h->magic != HVM_MAGIC) {
        *why = "bad magic (not an hvmem broker message)";
        return -EPROTO;
    }
    if (h->version != HVM_VERSION) {
        *why = "unsupported protocol version (this broker speaks 1)";
        return -EPROTONOSUPPORT;
    }
    if (h->length > max) {
        *why = reply ? "reply longer than the protocol's limit"
                     : "request longer than the protocol's limit";
        return -EMSGSIZE;
    }
    if (reply != !!(h->op & HVM_OP_REPLY)) {
        *why = reply ? "not a reply" : "a reply where a request was expected";
        return -EPROTO;
    }
    return 0;
}

void hvm_header_encode(uint8_t *buf, const HvmHeader *h)
{
    GByteArray *b = g_byte_array_sized_new(HVM_HDR_SIZE);

    hvm_put_u32(b, h->magic);
    hvm_put_u16(b, h->version);
    hvm_put_u16(b, h->op);
    hvm_put_u32(b, h->length);
    hvm_put_u32(b, h->seq);
    memcpy(buf, b->data, HVM_HDR_SIZE);
    g_byte_array_free(b, TRUE);
}

static int copy_name(HvmReader *r, size_t len, char *dst, const char *what,
                     char *err, size_t errlen)
{
    const uint8_t *p = hvm_get_bytes(r, len);
    const char *why;

    if (!p) {
        snprintf(err, errlen, "%s runs past the end of the request", what);
        return -EINVAL;
    }
    why = hvm_name_check((const char *)p, len);
    if (why) {
        snprintf(err, errlen, "invalid %s: %s", what, why);
        return len > HVM_NAME_MAX ? -ENAMETOOLONG : -EINVAL;
    }
    memcpy(dst, p, len);
    dst[len] = '\0';
    return 0;
}

int hvm_request_decode(uint16_t op, uint32_t seq, const uint8_t *body,
                       size_t len, HvmRequest *req, char *err, size_t errlen)
{
    HvmReader r;
    uint16_t name_len, item_len;
    uint32_t reserved;
    unsigned f;
    int ret;

    memset(req, 0, sizeof(*req));
    if (op == 0 || op >= HVM_OP__MAX) {
        snprintf(err, errlen, "unknown op %u", op);
        return -EOPNOTSUPP;
    }
    f = op_fields[op];
    req->op = op;
    req->seq = seq;
    if (len < HVM_REQ_FIXED || len > HVM_MAX_REQ_BODY) {
        snprintf(err, errlen, "request body of %zu bytes (must be %d..%d)",
                 len, HVM_REQ_FIXED, HVM_MAX_REQ_BODY);
        return -EINVAL;
    }
    hvm_reader_init(&r, body, len);
    req->size = hvm_get_u64(&r);
    req->mode = hvm_get_u32(&r);
    req->flags = hvm_get_u32(&r);
    name_len = hvm_get_u16(&r);
    item_len = hvm_get_u16(&r);
    reserved = hvm_get_u32(&r);
    if ((size_t)HVM_REQ_FIXED + name_len + item_len != len) {
        snprintf(err, errlen, "name lengths %u + %u do not add up to the "
                 "body's %zu bytes", name_len, item_len, len);
        return -EINVAL;
    }
    if (reserved) {
        snprintf(err, errlen, "reserved field is %u (must be 0)", reserved);
        return -EINVAL;
    }
    if (f & F_SIZE) {
        if (req->size == 0 || req->size > HVM_MAX_SIZE) {
            snprintf(err, errlen, "size %" G_GUINT64_FORMAT " out of range "
                     "(1..%llu)", req->size, HVM_MAX_SIZE);
            return -EINVAL;
        }
    } else if (req->size) {
        snprintf(err, errlen, "%s takes no size", hvm_op_name(op));
        return -EINVAL;
    }
    if (f & F_MODE) {
        if (req->mode & ~HVM_MODE_MASK) {
            snprintf(err, errlen, "mode %o has bits outside %o (only r and w "
                     "for owner, group and other)", req->mode, HVM_MODE_MASK);
            return -EINVAL;
        }
    } else if (req->mode) {
        snprintf(err, errlen, "%s takes no mode", hvm_op_name(op));
        return -EINVAL;
    }
    if (req->flags & ~((f & F_MAPFLAGS) ? HVM_MAP_RW : 0)) {
        snprintf(err, errlen, "unknown flags 0x%x for %s", req->flags,
                 hvm_op_name(op));
        return -EINVAL;
    }
    if (name_len || (f & F_NAME)) {
        if (!(f & (F_NAME | F_NAME_OPT))) {
            snprintf(err, errlen, "%s takes no region name", hvm_op_name(op));
            return -EINVAL;
        }
        ret = copy_name(&r, name_len, req->name, "region name", err, errlen);
        if (ret) {
            return ret;
        }
    }
    if (item_len || (f & F_ITEM)) {
        if (!(f & F_ITEM)) {
            snprintf(err, errlen, "%s takes no item name", hvm_op_name(op));
            return -EINVAL;
        }
        ret = copy_name(&r, item_len, req->item, "item name", err, errlen);
        if (ret) {
            return ret;
        }
    }
    g_assert(!r.err && r.off == len);
    return 0;
}

void hvm_request_encode(GByteArray *out, const HvmRequest *req)
{
    size_t nl = strnlen(req->name, HVM_NAME_MAX);
    size_t il = strnlen(req->item, HVM_NAME_MAX);
    uint8_t hdr[HVM_HDR_SIZE];
    HvmHeader h = {
        .magic = HVM_MAGIC, .version = HVM_VERSION, .op = req->op,
        .length = HVM_REQ_FIXED + nl + il, .seq = req->seq,
    };

    hvm_header_encode(hdr, &h);
    g_byte_array_append(out, hdr, sizeof(hdr));
    hvm_put_u64(out, req->size);
    hvm_put_u32(out, req->mode);
    hvm_put_u32(out, req->flags);
    hvm_put_u16(out, nl);
    hvm_put_u16(out, il);
    hvm_put_u32(out, 0);
    g_byte_array_append(out, (const uint8_t *)req->name, nl);
    g_byte_array_append(out, (const uint8_t *)req->item, il);
}

void hvm_reply_encode(GByteArray *out, uint16_t op, uint32_t seq, int32_t status,
                      const char *msg, const void *data, size_t data_len)
{
    size_t ml = msg ? strnlen(msg, HVM_MAX_MSG) : 0;
    uint8_t hdr[HVM_HDR_SIZE];
    HvmHeader h = {
        .magic = HVM_MAGIC, .version = HVM_VERSION, .op = op | HVM_OP_REPLY,
        .length = HVM_REPLY_FIXED + ml + data_len, .seq = seq,
    };

    g_assert(data_len <= HVM_MAX_REPLY_DATA);
    hvm_header_encode(hdr, &h);
    g_byte_array_append(out, hdr, sizeof(hdr));
    hvm_put_u32(out, (uint32_t)status);
    hvm_put_u32(out, ml);
    hvm_put_u32(out, data_len);
    hvm_put_u32(out, 0);
    g_byte_array_append(out, (const uint8_t *)msg, ml);
    g_byte_array_append(out, data, data_len);
}

int hvm_reply_decode(const uint8_t *body, size_t len, HvmReply *rep,
                     const char **why)
{
    HvmReader r;
    uint32_t ml, dl;
    const uint8_t *m;

    hvm_reader_init(&r, body, len);
    rep->status = (int32_t)hvm_get_u32(&r);
    ml = hvm_get_u32(&r);
    dl = hvm_get_u32(&r);
    hvm_get_u32(&r);
    if (r.err || ml > HVM_MAX_MSG || dl > HVM_MAX_REPLY_DATA ||
        (size_t)HVM_REPLY_FIXED + ml + dl != len) {
        *why = "malformed reply body";
        return -EPROTO;
    }
    if (rep->status > 0 || rep->status < -4095) {
        *why = "reply status is not 0 or -errno";
        return -EPROTO;
    }
    m = hvm_get_bytes(&r, ml);
    memcpy(rep->msg, m, ml);
    rep->msg[ml] = '\0';
    rep->data = hvm_get_bytes(&r, dl);
    rep->data_len = dl;
    return 0;
}

static void put_name(GByteArray *b, const char *name)
{
    g_byte_array_append(b, (const uint8_t *)name, strnlen(name, HVM_NAME_MAX));
}

static int get_name(HvmReader *r, size_t len, char *dst)
{
    const uint8_t *p = hvm_get_bytes(r, len);

    if (!p || hvm_name_check((const char *)p, len)) {
        r->err = true;
        return -EPROTO;
    }
    memcpy(dst, p, len);
    dst[len] = '\0';
    return 0;
}

void hvm_region_encode(GByteArray *b, const HvmRegionInfo *ri)
{
    hvm_put_u64(b, ri->size);
    hvm_put_u64(b, ri->used);
    hvm_put_u64(b, ri->id);
    hvm_put_u32(b, ri->mode);
    hvm_put_u32(b, ri->uid);
    hvm_put_u32(b, ri->gid);
    hvm_put_u32(b, ri->nitems);
    hvm_put_u32(b, ri->attached);
    hvm_put_u32(b, ri->flags);
    hvm_put_u32(b, ri->lease_pid);
    hvm_put_u16(b, strnlen(ri->name, HVM_NAME_MAX));
    hvm_put_u16(b, 0);
    put_name(b, ri->name);
}

int hvm_region_decode(HvmReader *r, HvmRegionInfo *ri)
{
    uint16_t nl;

    ri->size = hvm_get_u64(r);
    ri->used = hvm_get_u64(r);
    ri->id = hvm_get_u64(r);
    ri->mode = hvm_get_u32(r);
    ri->uid = hvm_get_u32(r);
    ri->gid = hvm_get_u32(r);
    ri->nitems = hvm_get_u32(r);
    ri->attached = hvm_get_u32(r);
    ri->flags = hvm_get_u32(r);
    ri->lease_pid = hvm_get_u32(r);
    nl = hvm_get_u16(r);
    hvm_get_u16(r);
    if (r->err) {
        return -EPROTO;
    }
    return get_name(r, nl, ri->name);
}

void hvm_item_encode(GByteArray *b, const HvmItemInfo *ii)
{
    hvm_put_u64(b, ii->offset);
    hvm_put_u64(b, ii->size);
    hvm_put_u16(b, strnlen(ii->name, HVM_NAME_MAX));
    hvm_put_u16(b, 0);
    hvm_put_u32(b, 0);
    put_name(b, ii->name);
}

int hvm_item_decode(HvmReader *r, HvmItemInfo *ii)
{
    uint16_t nl;

    ii->offset = hvm_get_u64(r);
    ii->size = hvm_get_u64(r);
    nl = hvm_get_u16(r);
    hvm_get_u16(r);
    hvm_get_u32(r);
    if (r->err) {
        return -EPROTO;
    }
    return get_name(r, nl, ii->name);
}

void hvm_pool_encode(GByteArray *b, const HvmPoolInfo *pi)
{
    hvm_put_u64(b, pi->capacity);
    hvm_put_u64(b, pi->used);
    hvm_put_u64(b, pi->quota);
    hvm_put_u64(b, pi->caller_used);
    hvm_put_u32(b, pi->nregions);
    hvm_put_u32(b, pi->nconns);
    hvm_put_u32(b, pi->max_conns);
    hvm_put_u32(b, pi->align);
    hvm_put_u64(b, pi->item_align);
    hvm_put_u64(b, 0);
}

int hvm_pool_decode(HvmReader *r, HvmPoolInfo *pi)
{
    pi->capacity = hvm_get_u64(r);
    pi->used = hvm_get_u64(r);
    pi->quota = hvm_get_u64(r);
    pi->caller_used = hvm_get_u64(r);
    pi->nregions = hvm_get_u32(r);
    pi->nconns = hvm_get_u32(r);
    pi->max_conns = hvm_get_u32(r);
    pi->align = hvm_get_u32(r);
    pi->item_align = hvm_get_u64(r);
    pi->reserved = hvm_get_u64(r);
    return r->err ? -EPROTO : 0;
}

int hvm_parse_size(const char *s, uint64_t *out)
{
    char *end;
    guint64 v;
    unsigned shift = 0;

    if (!s || !g_ascii_isdigit(*s)) {
        return -EINVAL;
    }
    errno = 0;
    v = g_ascii_strtoull(s, &end, 10);
    if (errno) {
        return -EINVAL;
    }
    switch (g_ascii_toupper(*end)) {
    case '\0':
        break;
    case 'K':
        shift = 10;
        break;
    case 'M':
        shift = 20;
        break;
    case 'G':
        shift = 30;
        break;
    case 'T':
        shift = 40;
        break;
    default:
        return -EINVAL;
    }
    if (*end && end[1] && !(g_ascii_toupper(end[1]) == 'I' && end[2] == 'B' &&
                            !end[3]) && !(end[1] == 'B' && !end[2])) {
        return -EINVAL;
    }
    if (shift && v > (UINT64_MAX >> shift)) {
        return -EINVAL;
    }
    *out = v << shift;
    return 0;
}
