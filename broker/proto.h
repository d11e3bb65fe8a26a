/*
 * hvmem broker wire protocol: message layout, limits, encoder and decoder.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * Everything here is pure (no I/O, no global state) so that the request
 * parser can be unit-tested and fuzzed alone.  docs/broker.md describes the
 * layout in prose; the two must agree.  All integers are little-endian.
 *
 *   header (16 bytes):  u32 magic "HVMB" | u16 version | u16 op | u32 length | u32 seq
 *   request body:       u64 size | u32 mode | u32 flags | u16 name_len | u16 item_len |
 *                       u32 reserved (0) | name | item          (length = 24 + name_len + item_len)
 *   reply body:         i32 status (0 or -errno) | u32 msg_len | u32 data_len | u32 reserved |
 *                       msg | data                               (length = 16 + msg_len + data_len)
 *
 * A reply carries the request's op with HVM_OP_REPLY set and the request's
 * seq.  An unsolicited error (connection refused, framing lost) has op
 * HVM_OP_REPLY alone and seq 0; the broker closes the connection after it.
 */
#ifndef HVM_PROTO_H
#define HVM_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <glib.h>

#define HVM_MAGIC               0x424d5648u     /* "HVMB" as bytes on the wire */
#define HVM_VERSION             1
#define HVM_HDR_SIZE            16
#define HVM_REQ_FIXED           24
#define HVM_REPLY_FIXED         16
#define HVM_NAME_MAX            255
/* The largest request: the fixed part and two names of HVM_NAME_MAX. */
#define HVM_MAX_REQ_BODY        (HVM_REQ_FIXED + 2 * HVM_NAME_MAX)
#define HVM_MAX_MSG             1024            /* error message bytes in a reply */
#define HVM_MAX_REPLY_DATA      (4u << 20)      /* a LIST of HVM_MAX_REGIONS fits */
#define HVM_MAX_REPLY_BODY      (HVM_REPLY_FIXED + HVM_MAX_MSG + HVM_MAX_REPLY_DATA)
#define HVM_MAX_SIZE            (1ull << 50)    /* 1 PiB: any region or item size */
#define HVM_ITEM_ALIGN          (2ull << 20)    /* items are 2 MiB-aligned extents */
#define HVM_MAX_REGIONS         4096
#define HVM_MAX_ITEMS           1024            /* per region */
#define HVM_MODE_MASK           0666u           /* r and w for owner, group, other */

typedef enum HvmOp {
    HVM_OP_CREATE = 1,      /* name, size, mode */
    HVM_OP_LOOKUP,          /* name */
    HVM_OP_DESTROY,         /* name */
    HVM_OP_RESIZE,          /* name, size */
    HVM_OP_ALLOC,           /* name, item, size */
    HVM_OP_ITEM_LOOKUP,     /* name, item */
    HVM_OP_FREE,            /* name, item */
    HVM_OP_CHMOD,           /* name, mode */
    HVM_OP_STAT,            /* name (region and its items) or empty (the pool) */
    HVM_OP_LIST,            /* nothing */
    HVM_OP_MAP,             /* name, flags (HVM_MAP_RW); the reply carries an fd */
    HVM_OP_RELEASE,         /* name: give up this connection's read-write lease */
    HVM_OP_EXPORT_KEYS,     /* name, flags (HVM_MAP_RW): the keys of the remote
                             * clients that may attach to an export of the
                             * region this connection mapped (psk.h) */
    HVM_OP__MAX,
} HvmOp;

#define HVM_OP_REPLY            0x8000u
#define HVM_MAP_RW              0x1u

/* HvmRegionInfo.flags */
#define HVM_REGION_LEASED       0x1u    /* a read-write owner lease is held */
#define HVM_REGION_DESTROYED    0x2u    /* name gone, file kept for attached clients */

typedef struct HvmHeader {
    uint32_t magic;
    uint16_t version;
    uint16_t op;
    uint32_t length;
    uint32_t seq;
} HvmHeader;

/* A decoded request; the names point into the caller's buffer copy below. */
typedef struct HvmRequest {
    HvmOp op;
    uint32_t seq;
    uint64_t size;
    uint32_t mode;
    uint32_t flags;
    char name[HVM_NAME_MAX + 1];
    char item[HVM_NAME_MAX + 1];
} HvmRequest;

#define HVM_REGION_REC_FIXED    56
typedef struct HvmRegionInfo {
    uint64_t size;          /* bytes, rounded to the pool's alignment */
    uint64_t used;          /* bytes held by items */
    uint64_t id;            /* file name in the pool is r-<id> */
    uint32_t mode;
    uint32_t uid;
    uint32_t gid;
    uint32_t nitems;
    uint32_t attached;      /* connections that mapped it and are still open */
    uint32_t flags;         /* HVM_REGION_* */
    uint32_t lease_pid;     /* pid holding the read-write lease, 0 if none */
    char name[HVM_NAME_MAX + 1];
} HvmRegionInfo;

#define HVM_ITEM_REC_FIXED      24
typedef struct HvmItemInfo {
    uint64_t offset;
    uint64_t size;
    char name[HVM_NAME_MAX + 1];
} HvmItemInfo;

#define HVM_POOL_REC_FIXED      64
typedef struct HvmPoolInfo {
    uint64_t capacity;      /* bytes the broker may hand out */
    uint64_t used;          /* bytes in regions, destroyed-but-attached ones too */
    uint64_t quota;         /* the caller's quota, 0 = none */
    uint64_t caller_used;   /* bytes in the caller's regions */
    uint32_t nregions;
    uint32_t nconns;
    uint32_t max_conns;
    uint32_t align;         /* region size granule of the pool's file system */
    uint64_t item_align;
    uint64_t reserved;
} HvmPoolInfo;

typedef struct HvmReply {
    int32_t status;
    char msg[HVM_MAX_MSG + 1];
    const uint8_t *data;    /* points into the reply body */
    uint32_t data_len;
} HvmReply;

/* A bounded little-endian reader over a byte buffer; errors are sticky. */
typedef struct HvmReader {
    const uint8_t *p;
    size_t len;
    size_t off;
    bool err;
} HvmReader;

void hvm_reader_init(HvmReader *r, const void *p, size_t len);
uint16_t hvm_get_u16(HvmReader *r);
uint32_t hvm_get_u32(HvmReader *r);
uint64_t hvm_get_u64(HvmReader *r);
const uint8_t *hvm_get_bytes(HvmReader *r, size_t n);

void hvm_put_u16(GByteArray *b, uint16_t v);
void hvm_put_u32(GByteArray *b, uint32_t v);
void hvm_put_u64(GByteArray *b, uint64_t v);

const char *hvm_op_name(unsigned op);

/*
 * Name rules: 1..255 bytes, printable ASCII (0x21..0x7e: no space, no
 * control, no NUL), no '/', not "." or "..", no "..".  Returns NULL when
 * @name (of @len bytes) is valid, else a static reason.
 */
const char *hvm_name_check(const char *name, size_t len);

/* Header: decode 16 bytes; returns 0 or -errno with @why set (static). */
int hvm_header_decode(const uint8_t *buf, HvmHeader *h, bool reply,
                      const char **why);
void hvm_header_encode(uint8_t *buf, const HvmHeader *h);

/*
 * Request body: validates every field against the op's rules (which fields
 * it takes, bounds, names).  Returns 0, or -errno with a message in @err
 * (of @errlen bytes).  Never reads outside body[0..len).
 */
int hvm_request_decode(uint16_t op, uint32_t seq, const uint8_t *body,
                       size_t len, HvmRequest *req, char *err, size_t errlen);
/* A whole request (header + body), appended to @out. */
void hvm_request_encode(GByteArray *out, const HvmRequest *req);

/* A whole reply (header + body) appended to @out. */
void hvm_reply_encode(GByteArray *out, uint16_t op, uint32_t seq, int32_t status,
                      const char *msg, const void *data, size_t data_len);
/* A reply body; @rep->data points into @body. */
int hvm_reply_decode(const uint8_t *body, size_t len, HvmReply *rep,
                     const char **why);

void hvm_region_encode(GByteArray *b, const HvmRegionInfo *ri);
int hvm_region_decode(HvmReader *r, HvmRegionInfo *ri);
void hvm_item_encode(GByteArray *b, const HvmItemInfo *ii);
int hvm_item_decode(HvmReader *r, HvmItemInfo *ii);
void hvm_pool_encode(GByteArray *b, const HvmPoolInfo *pi);
int hvm_pool_decode(HvmReader *r, HvmPoolInfo *pi);

/*
 * "4096", "64K", "2M", "1G", "1T" (binary units) to bytes; 0 or -EINVAL
 * (also on overflow).
 */
int hvm_parse_size(const char *s, uint64_t *out);

#endif
