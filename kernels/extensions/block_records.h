/* block_records.h: the block pool's per-block hash records and digest -> block table (kvmesh/kv/block_index.py).
 *
 *   keys            uint64[2 * num_slots]  slot s holds a 16-byte digest as keys[2s] (bytes 0-7), keys[2s+1]
 *   vals            int32[num_slots]       slot s's block, EMPTY (-1) for a free slot
 *   slot_of_block   int32[num_blocks]      where block b's digest sits, -1 while b holds none
 *   parents         int32[num_blocks]      the block holding the previous digest of b's chain, -1 for a root
 *   num_children    int32[num_blocks]      blocks whose parent b is
 *
 * The table is open addressing with linear probing. num_slots is a power of two (mask = num_slots - 1)
 * at least twice the pool's blocks: a block holds at most one digest, so the table is never more than
 * half full and never grows. A digest's home slot is its first eight bytes masked (digests are BLAKE2b
 * output: uniform already). Removal moves the entries behind the freed slot back (backward-shift
 * deletion), so there are no tombstones and probes stay short.
 *
 * Adding and removing digests here also keeps the parent links and child counts, so a run of new
 * blocks is recorded in one call whatever its ids, and a match's blocks come from one walk up the
 * links. All memory is the caller's (numpy arrays and array.array buffers, described by a block_index_t
 * whose address the caller passes and keeps alive). block_index.c is the CPython interface.
 */
#ifndef KVMESH_BLOCK_RECORDS_H
#define KVMESH_BLOCK_RECORDS_H
#include <stdint.h>
#include <string.h>

#define EMPTY (-1)    /* a free slot in vals */
#define NO_SLOT (-1)  /* slot_of_block of a block holding no digest */
#define NO_BLOCK (-1) /* parents of a root, or of a block holding no digest */

typedef struct {
    uint64_t *keys;
    int32_t *vals;
    int64_t mask;
    int32_t *slot_of_block;
    int32_t *parents;
    int32_t *num_children;
    int64_t num_blocks; /* ids outside [0, num_blocks) are refused, never dereferenced */
} block_index_t;

static inline int is_block(const block_index_t *ix, int64_t b) { return b >= 0 && b < ix->num_blocks; }

typedef struct {
    uint64_t lo, hi;
} digest_t;

static inline digest_t load_digest(const uint8_t *p) {
    digest_t d;
    memcpy(&d.lo, p, 8);
    memcpy(&d.hi, p + 8, 8);
    return d;
}

/* The slot holding `d`, else the empty slot where its probe ends (negative-encoded as -(slot + 1)). */
static inline int64_t probe(const block_index_t *ix, digest_t d) {
    int64_t s = (int64_t)(d.lo & (uint64_t)ix->mask);
    while (ix->vals[s] != EMPTY) {
        if (ix->keys[2 * s] == d.lo && ix->keys[2 * s + 1] == d.hi) return s;
        s = (s + 1) & ix->mask;
    }
    return -(s + 1);
}

/* Empty slot `hole`, moving back the entries of its cluster that may fill it. */
static void clear_slot(block_index_t *ix, int64_t hole) {
    const int64_t mask = ix->mask;
    for (int64_t s = (hole + 1) & mask; ix->vals[s] != EMPTY; s = (s + 1) & mask) {
        int64_t home = (int64_t)(ix->keys[2 * s] & (uint64_t)mask);
        /* the entry at s stays unless its home lies cyclically outside (hole, s] */
        int stays = hole <= s ? (hole < home && home <= s) : (hole < home || home <= s);
        if (stays) continue;
        ix->keys[2 * hole] = ix->keys[2 * s];
        ix->keys[2 * hole + 1] = ix->keys[2 * s + 1];
        ix->vals[hole] = ix->vals[s];
        ix->slot_of_block[ix->vals[hole]] = (int32_t)hole;
        hole = s;
    }
    ix->vals[hole] = EMPTY;
}

/* Forget block b's digest and links (b holds one). */
static void unlink_block(block_index_t *ix, int64_t b) {
    clear_slot(ix, ix->slot_of_block[b]);
    ix->slot_of_block[b] = NO_SLOT;
    int32_t parent = ix->parents[b];
    if (parent != NO_BLOCK) ix->num_children[parent]--;
    ix->parents[b] = NO_BLOCK;
}

/* The block holding `digest`, or -1. */
static int64_t block_index_find(const block_index_t *ix, const uint8_t *digest) {
    int64_t s = probe(ix, load_digest(digest));
    return s >= 0 ? ix->vals[s] : -1;
}

/* Block b's digest into out[16]; returns 1, 0 (out untouched) when b holds none, -1 when b is no block. */
static int64_t block_index_digest_of(const block_index_t *ix, int64_t b, uint8_t *out) {
    if (!is_block(ix, b)) return -1;
    int32_t s = ix->slot_of_block[b];
    if (s < 0) return 0;
    memcpy(out, &ix->keys[2 * s], 8);
    memcpy(out + 8, &ix->keys[2 * s + 1], 8);
    return 1;
}

/* Record n new digests in blocks ids[i] (or first_block + i when ids is NULL), chained: block i's parent
 * is block i - 1, the first one's is `parent` (-1 for a root). All or none. Returns -1 once recorded;
 * i >= 0 when digest i is already held (or repeated in the run); -2 - i when block i already holds a
 * digest or is no block. A block holding no digest is nobody's parent, so each run block but the last
 * gets one child. */
static int64_t block_index_add_run(block_index_t *ix, const uint8_t *digests, int64_t n, const int32_t *ids,
                            int64_t first_block, int64_t parent) {
    for (int64_t i = 0; i < n; i++) {
        int64_t b = ids ? ids[i] : first_block + i;
        if (!is_block(ix, b) || ix->slot_of_block[b] >= 0) return -2 - i;
    }
    if (parent >= 0 && !is_block(ix, parent)) return -2 - n;
    for (int64_t i = 0; i < n; i++) {
        int64_t b = ids ? ids[i] : first_block + i;
        digest_t d = load_digest(digests + 16 * i);
        int64_t s = probe(ix, d);
        if (s >= 0 || ix->slot_of_block[b] >= 0) { /* held already, or a block twice: take the run back */
            for (int64_t j = i - 1; j >= 0; j--) unlink_block(ix, ids ? ids[j] : first_block + j);
            return s >= 0 ? i : -2 - i;
        }
        s = -s - 1;
        ix->keys[2 * s] = d.lo;
        ix->keys[2 * s + 1] = d.hi;
        ix->vals[s] = (int32_t)b;
        ix->slot_of_block[b] = (int32_t)s;
        int64_t p = i ? (ids ? ids[i - 1] : first_block + i - 1) : parent;
        ix->parents[b] = (int32_t)p;
        if (p >= 0) ix->num_children[p]++;
    }
    return -1;
}

/* Forget block b's digest and links; returns its parent (-1 for a root) with the digest in out[16],
 * -2 (out untouched) when b holds none, -3 when b is no block. The caller checks b has no children. */
static int64_t block_index_remove_block(block_index_t *ix, int64_t b, uint8_t *out) {
    int64_t held = block_index_digest_of(ix, b, out);
    if (held <= 0) return held == 0 ? -2 : -3;
    int64_t parent = ix->parents[b];
    unlink_block(ix, b);
    return parent;
}

/* block_index_remove_block for ids[0..n) in order, in one call (an eviction's victims): block i's digest into
 * digests[16 i], its parent's (as it was before any removal here) into parent_digests[16 i], and parents[i] =
 * its parent (-1 for a root), or -2 when it held no digest (nothing written), -3 when it is no block.
 * Returns how many held one. A block removed here may be the parent of one removed before it. */
/* block_index_remove_block, with the parent's digest (as it was) into parent_digest when b has a parent. */
static int64_t block_index_remove_reporting(block_index_t *ix, int64_t b, uint8_t *digest, uint8_t *parent_digest) {
    if (is_block(ix, b) && ix->parents[b] != NO_BLOCK) /* a block holding no digest has no parent */
        block_index_digest_of(ix, ix->parents[b], parent_digest);
    return block_index_remove_block(ix, b, digest);
}

static int64_t block_index_remove_blocks(block_index_t *ix, const int32_t *ids, int64_t n, uint8_t *digests,
                                  uint8_t *parent_digests, int32_t *parents) {
    int64_t num_removed = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t parent = block_index_remove_reporting(ix, ids[i], digests + 16 * i, parent_digests + 16 * i);
        parents[i] = (int32_t)parent;
        num_removed += parent >= NO_BLOCK;
    }
    return num_removed;
}

/* 0 when every invariant of the table and the per-block records holds, else a negative code. */
static int64_t block_index_check(const block_index_t *ix) {
    const int64_t num_blocks = ix->num_blocks;
    int64_t held = 0, entries = 0;
    for (int64_t b = 0; b < num_blocks; b++) {
        int32_t s = ix->slot_of_block[b];
        if (s < 0) continue;
        held++;
        if (s > ix->mask || ix->vals[s] != b) return -1; /* a block points at a slot that is not its own */
    }
    for (int64_t s = 0; s <= ix->mask; s++) {
        if (ix->vals[s] == EMPTY) continue;
        entries++;
        int64_t b = ix->vals[s];
        if (b < 0 || b >= num_blocks || ix->slot_of_block[b] != s) return -2; /* an entry no block owns */
        digest_t d = {ix->keys[2 * s], ix->keys[2 * s + 1]};
        if (probe(ix, d) != s) return -3; /* unreachable from its home slot */
    }
    return held == entries ? 0 : -4;
}

#endif
