/*
 * hvmem broker catalogue: regions, their items, the extent allocator and the
 * durable snapshot.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * On-disk snapshot (all little-endian), file "catalog" in the state dir:
 *
 *   header (48 bytes): u64 magic "HVMCATLG" | u32 version (1) | u32 nregions |
 *                      u64 next_id | u64 generation | u32 body_len |
 *                      u32 body_crc (CRC-32 of the body) | u32 hdr_crc (CRC-32
 *                      of the 40 bytes before it) | u32 reserved (0)
 *   body, per region:  u16 name_len | u16 nitems | u32 mode | u32 uid | u32 gid |
 *                      u64 id | u64 size | name |
 *                      nitems x (u64 offset | u64 size | u16 name_len | u16 0 |
 *                                u32 0 | name)
 *
 * Commit protocol (hvm_catalog_save): write the whole snapshot to
 * "catalog.tmp", fsync it, rename it over "catalog", fsync the directory.
 * A crash leaves either the old or the new snapshot, never a mix; a stray
 * catalog.tmp is ignored and overwritten.  The rename is the commit point:
 * a failure before it changes nothing (an error), a failure after it (the
 * directory fsync) is a warning, the change being made.  The broker replies
 * to a mutating request only after the commit.
 */
#ifndef HVM_CATALOG_H
#define HVM_CATALOG_H

#include <glib.h>
#include <stdint.h>

#include "proto.h"

#define HVM_CAT_MAGIC       0x474c5441434d5648ull  /* "HVMCATLG" */
#define HVM_CAT_VERSION     1
#define HVM_CAT_HDR_SIZE    48
/* The largest valid snapshot: every region with every item, longest names. */
#define HVM_CAT_MAX_SIZE    ((uint64_t)HVM_CAT_HDR_SIZE + (uint64_t)HVM_MAX_REGIONS * \
                             (36 + HVM_NAME_MAX + HVM_MAX_ITEMS * (24 + HVM_NAME_MAX)))

typedef struct HvmItem {
    char *name;
    uint64_t offset;
    uint64_t size;
} HvmItem;

typedef struct HvmRegion {
    char *name;
    uint64_t id;
    uint64_t size;
    uint32_t mode;
    uint32_t uid;
    uint32_t gid;
    GPtrArray *items;       /* HvmItem *, sorted by offset, non-overlapping */

    /* Runtime state of the daemon, not in the snapshot. */
    bool destroyed;         /* out of the catalogue; freed when attached == 0 */
    unsigned attached;      /* connections that mapped it */
    void *lease;            /* the connection holding the read-write lease */
    uint32_t lease_pid;
    void *last_lease;       /* the connection that released it, while open */
    uint32_t last_lease_pid;    /* the last holder's pid, 0 if none since start */
} HvmRegion;

typedef struct HvmCatalog {
    GHashTable *regions;    /* name -> HvmRegion *, owns the regions */
    GPtrArray *by_id;       /* the same regions by id (the file's order) */
    uint64_t next_id;
    uint64_t generation;    /* bumped by every save */
} HvmCatalog;

HvmCatalog *hvm_catalog_new(void);
void hvm_catalog_free(HvmCatalog *cat);
HvmRegion *hvm_region_new(const char *name, uint64_t id, uint64_t size,
                          uint32_t mode, uint32_t uid, uint32_t gid);
void hvm_region_free(HvmRegion *r);
/* Put @r in the catalogue (its name and id not in it), or take it out. */
void hvm_catalog_add(HvmCatalog *cat, HvmRegion *r);
void hvm_catalog_remove(HvmCatalog *cat, HvmRegion *r);

/* Bytes of @r held by items. */
uint64_t hvm_region_used(const HvmRegion *r);
HvmItem *hvm_region_find_item(const HvmRegion *r, const char *name);
/*
 * First-fit: the lowest 2 MiB-aligned offset where @size (rounded up to
 * 2 MiB) fits between the items and before the region's end.  Returns the
 * new item (owned by @r), or NULL with -ENOSPC/-EEXIST/-ENOSPC in *@err.
 */
HvmItem *hvm_region_alloc_item(HvmRegion *r, const char *name, uint64_t size,
                               int *err);
/* Put back an item at a known free extent (undo of a free). */
void hvm_region_insert_item(HvmRegion *r, const char *name, uint64_t offset,
                            uint64_t size);
int hvm_region_free_item(HvmRegion *r, const char *name);
/* End of the last item (0 if none): a region may not shrink below it. */
uint64_t hvm_region_items_end(const HvmRegion *r);

uint32_t hvm_crc32(uint32_t crc, const void *buf, size_t len);

/* Serialise to a new byte array (header + body). */
GByteArray *hvm_catalog_serialize(const HvmCatalog *cat);
/*
 * Parse a snapshot; every field is validated (names, bounds, overlaps,
 * duplicate names and ids).  Returns NULL with @errp set on anything wrong.
 */
HvmCatalog *hvm_catalog_parse(const uint8_t *buf, size_t len, GError **errp);

/*
 * Commit protocol above, in the directory open as @dfd (@dir names it in
 * messages).  Returns 0 once committed (a later failure is a warning), or
 * -errno with @errp set when nothing changed on disk.
 */
int hvm_catalog_save(HvmCatalog *cat, int dfd, const char *dir, GError **errp);
/* Load "catalog" from the directory @dfd; a missing file gives an empty one. */
HvmCatalog *hvm_catalog_load(int dfd, const char *dir, GError **errp);

#endif
