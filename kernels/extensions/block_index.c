/* The block pool's per-block hash records and digest -> block table (kvmesh/kv/block_index.py).
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
 * whose address the caller passes first and keeps alive). This is a CPython extension (the functions at
 * the end): each call holds the GIL, so one call is atomic for Python threads, and reads the caller's
 * lists of digests and block ids in place.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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
static int64_t block_index_remove_blocks(block_index_t *ix, const int32_t *ids, int64_t n, uint8_t *digests,
                                  uint8_t *parent_digests, int32_t *parents) {
    int64_t num_removed = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        if (is_block(ix, b) && ix->parents[b] != NO_BLOCK) /* a block holding no digest has no parent */
            block_index_digest_of(ix, ix->parents[b], parent_digests + 16 * i);
        int64_t parent = block_index_remove_block(ix, b, digests + 16 * i);
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


/* ---- the Python interface ------------------------------------------------------------------------- */

static block_index_t *index_at(PyObject *address) {
    block_index_t *ix = PyLong_AsVoidPtr(address);
    if (ix == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "no block index at address 0");
    return ix;
}

/* A 16-byte digest held by a bytes object, or NULL with TypeError. */
static const uint8_t *digest_bytes(PyObject *h, Py_ssize_t i) {
    if (!PyBytes_Check(h) || PyBytes_GET_SIZE(h) != 16) {
        PyErr_Format(PyExc_ValueError, "block hash %zd is not 16 bytes", i);
        return NULL;
    }
    return (const uint8_t *)PyBytes_AS_STRING(h);
}

/* The ids of a list or tuple of ints, n of them, into out (int32); -1 with an error set. */
static int read_ids(PyObject *seq, Py_ssize_t n, int32_t *out) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        long b = PyLong_AsLong(items[i]);
        if (b == -1 && PyErr_Occurred())
            return -1;
        out[i] = b < INT32_MIN || b > INT32_MAX ? -1 : (int32_t)b; /* -1: no block, refused below */
    }
    return 0;
}

#define CHECK_ARGS(count, usage)                                                                               \
    if (nargs != (count)) {                                                                                    \
        PyErr_SetString(PyExc_TypeError, usage);                                                              \
        return NULL;                                                                                           \
    }

/* find(ix, digest) -> block, or -1 (also for anything that is no 16-byte bytes object) */
static PyObject *py_find(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(2, "find(ix, digest)");
    block_index_t *ix = index_at(args[0]);
    if (ix == NULL)
        return NULL;
    if (!PyBytes_Check(args[1]) || PyBytes_GET_SIZE(args[1]) != 16)
        return PyLong_FromLong(-1);
    return PyLong_FromLongLong(block_index_find(ix, (const uint8_t *)PyBytes_AS_STRING(args[1])));
}

/* digest_of(ix, block) -> bytes, None when it holds none; IndexError when it is no block */
static PyObject *py_digest_of(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(2, "digest_of(ix, block)");
    block_index_t *ix = index_at(args[0]);
    long long b = PyLong_AsLongLong(args[1]);
    if (ix == NULL || (b == -1 && PyErr_Occurred()))
        return NULL;
    uint8_t out[16];
    int64_t held = block_index_digest_of(ix, b, out);
    if (held < 0)
        return PyErr_Format(PyExc_IndexError, "block %lld is not one of this pool's %lld", b, (long long)ix->num_blocks);
    if (held == 0)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)out, 16);
}

/* add_run(ix, digests: list|tuple, ids: list|tuple|None, first_block, parent) -> block_index_add_run's result;
 * ids None: the blocks are first_block, first_block + 1, ... */
static PyObject *py_add_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(5, "add_run(ix, digests, ids, first_block, parent)");
    block_index_t *ix = index_at(args[0]);
    long long first = PyLong_AsLongLong(args[3]), parent = PyLong_AsLongLong(args[4]);
    if (ix == NULL || PyErr_Occurred())
        return NULL;
    PyObject *digests = PySequence_Fast(args[1], "digests must be a list or tuple");
    if (digests == NULL)
        return NULL;
    PyObject *ids = args[2] == Py_None ? NULL : PySequence_Fast(args[2], "ids must be a list, tuple or None");
    Py_ssize_t n = PySequence_Fast_GET_SIZE(digests);
    PyObject *result = NULL;
    uint8_t *joined = PyMem_Malloc(16 * (size_t)n + 1);
    int32_t *id_buf = ids != NULL ? PyMem_Malloc(sizeof(int32_t) * (size_t)n + 1) : NULL;
    if (args[2] != Py_None && ids == NULL)
        goto done;
    if (joined == NULL || (ids != NULL && id_buf == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    if (ids != NULL && PySequence_Fast_GET_SIZE(ids) != n) {
        PyErr_SetString(PyExc_ValueError, "one block id per hash expected");
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(digests);
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *d = digest_bytes(items[i], i);
        if (d == NULL)
            goto done;
        memcpy(joined + 16 * i, d, 16);
    }
    if (ids != NULL && read_ids(ids, n, id_buf) < 0)
        goto done;
    result = PyLong_FromLongLong(block_index_add_run(ix, joined, n, id_buf, first, parent));
done:
    PyMem_Free(joined);
    PyMem_Free(id_buf);
    Py_DECREF(digests);
    Py_XDECREF(ids);
    return result;
}

/* remove_block(ix, block) -> (parent, digest), None when it held none; IndexError when it is no block */
static PyObject *py_remove_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(2, "remove_block(ix, block)");
    block_index_t *ix = index_at(args[0]);
    long long b = PyLong_AsLongLong(args[1]);
    if (ix == NULL || (b == -1 && PyErr_Occurred()))
        return NULL;
    uint8_t out[16];
    int64_t parent = block_index_remove_block(ix, b, out);
    if (parent == -3)
        return PyErr_Format(PyExc_IndexError, "block %lld is not one of this pool's %lld", b, (long long)ix->num_blocks);
    if (parent == -2)
        Py_RETURN_NONE;
    return Py_BuildValue("(Ly#)", (long long)parent, (const char *)out, (Py_ssize_t)16);
}

/* remove_blocks(ix, ids, with_hashes) -> (parents: list, hashes, parent_hashes, num_removed), as
 * block_index_remove_blocks; the two digest strings are empty when with_hashes is false. IndexError names the
 * first id that is no block (nothing removed then). */
static PyObject *py_remove_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(3, "remove_blocks(ix, ids, with_hashes)");
    block_index_t *ix = index_at(args[0]);
    int with_hashes = PyObject_IsTrue(args[2]);
    if (ix == NULL || with_hashes < 0)
        return NULL;
    PyObject *ids = PySequence_Fast(args[1], "ids must be a list or tuple");
    if (ids == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    PyObject *result = NULL, *parents = NULL;
    int32_t *id_buf = PyMem_Malloc(sizeof(int32_t) * 2 * (size_t)n + 1);
    uint8_t *digests = PyMem_Malloc(32 * (size_t)n + 1);
    if (id_buf == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_ids(ids, n, id_buf) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!is_block(ix, id_buf[i])) {
            PyErr_Format(PyExc_IndexError, "block %S is not one of this pool's %lld",
                         PySequence_Fast_ITEMS(ids)[i], (long long)ix->num_blocks);
            goto done;
        }
    int32_t *parent_ids = id_buf + n;
    int64_t num_removed = block_index_remove_blocks(ix, id_buf, n, digests, digests + 16 * n, parent_ids);
    parents = PyList_New(n);
    if (parents == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyLong_FromLong(parent_ids[i]);
        if (p == NULL)
            goto done;
        PyList_SET_ITEM(parents, i, p);
    }
    result = Py_BuildValue("(Oy#y#L)", parents, (const char *)digests, with_hashes ? 16 * n : 0,
                           (const char *)digests + 16 * n, with_hashes ? 16 * n : 0, (long long)num_removed);
done:
    Py_XDECREF(parents);
    PyMem_Free(id_buf);
    PyMem_Free(digests);
    Py_DECREF(ids);
    return result;
}

/* count_held(ix, ids, digests) -> how many leading ids still hold digests[i] (over the shorter of the two) */
static PyObject *py_count_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(3, "count_held(ix, ids, digests)");
    block_index_t *ix = index_at(args[0]);
    if (ix == NULL)
        return NULL;
    PyObject *ids = PySequence_Fast(args[1], "ids must be a list or tuple");
    if (ids == NULL)
        return NULL;
    PyObject *digests = PySequence_Fast(args[2], "digests must be a list or tuple");
    if (digests == NULL) {
        Py_DECREF(ids);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids), num = 0;
    if (PySequence_Fast_GET_SIZE(digests) < n)
        n = PySequence_Fast_GET_SIZE(digests);
    PyObject **id_items = PySequence_Fast_ITEMS(ids), **digest_items = PySequence_Fast_ITEMS(digests);
    for (; num < n; num++) {
        long b = PyLong_AsLong(id_items[num]);
        if (b == -1 && PyErr_Occurred())
            break;
        PyObject *h = digest_items[num];
        if (!is_block(ix, b) || !PyBytes_Check(h) || PyBytes_GET_SIZE(h) != 16)
            break;
        int32_t s = ix->slot_of_block[b];
        digest_t d = load_digest((const uint8_t *)PyBytes_AS_STRING(h));
        if (s < 0 || ix->keys[2 * s] != d.lo || ix->keys[2 * s + 1] != d.hi)
            break;
    }
    Py_DECREF(ids);
    Py_DECREF(digests);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(num);
}

/* chain(ix, last, length, block_ids: list) -> the chain's blocks (block_ids' own int objects), root side first;
 * ValueError when it is shorter than length */
static PyObject *py_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(4, "chain(ix, last, length, block_ids)");
    block_index_t *ix = index_at(args[0]);
    long long last = PyLong_AsLongLong(args[1]);
    Py_ssize_t length = PyLong_AsSsize_t(args[2]);
    if (ix == NULL || PyErr_Occurred())
        return NULL;
    if (!PyList_Check(args[3]) || PyList_GET_SIZE(args[3]) != ix->num_blocks || length < 0) {
        PyErr_SetString(PyExc_ValueError, "chain: block_ids must be the pool's id list, length >= 0");
        return NULL;
    }
    PyObject *out = PyList_New(length);
    if (out == NULL)
        return NULL;
    int64_t block = last;
    for (Py_ssize_t i = length - 1; i >= 0; i--) {
        if (!is_block(ix, block)) {
            Py_DECREF(out);
            return PyErr_Format(PyExc_ValueError, "the chain ending at block %lld is shorter than %zd", last, length);
        }
        PyObject *id = PyList_GET_ITEM(args[3], block);
        Py_INCREF(id);
        PyList_SET_ITEM(out, i, id);
        block = ix->parents[block];
    }
    return out;
}

/* take_free(ix, next, prev, ids, num) -> (taken, parents, hashes, parent_hashes, num_removed): unlink the num
 * least recently used free blocks that are no cached block's parent from the pool's free queue (the Python
 * lists next / prev, sentinel at index num_blocks, their items the pool's id objects) and forget their
 * digests as they go, so a parent whose children were all taken becomes a leaf (the walk then starts over
 * from the head if it passed that parent): what taking them one by one from the head gives. taken holds the
 * pool's id objects in the order taken (a parent after its children); the rest is remove_blocks's answer for
 * them. RuntimeError when the queue runs out first (the caller checked there are num free blocks: that
 * every block left is a cached block's parent cannot be). */
static PyObject *py_take_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(5, "take_free(ix, next, prev, ids, num)");
    block_index_t *ix = index_at(args[0]);
    PyObject *next = args[1], *prev = args[2], *ids = args[3];
    Py_ssize_t num = PyLong_AsSsize_t(args[4]);
    if (ix == NULL || (num == -1 && PyErr_Occurred()))
        return NULL;
    const Py_ssize_t sentinel = ix->num_blocks;
    if (!PyList_Check(next) || !PyList_Check(prev) || !PyList_Check(ids) || PyList_GET_SIZE(next) != sentinel + 1 ||
        PyList_GET_SIZE(prev) != sentinel + 1 || PyList_GET_SIZE(ids) != sentinel || num < 0 || num > sentinel) {
        PyErr_SetString(PyExc_ValueError, "take_free: the pool's queue lists (num_blocks + 1), its ids, 0 <= num");
        return NULL;
    }
    PyObject *taken = NULL, *parents = NULL, *result = NULL;
    int32_t *taken_ids = PyMem_Malloc(sizeof(int32_t) * (2 * (size_t)num + (size_t)sentinel) + 1);
    int32_t *parent_ids = taken_ids + num, *skipped = taken_ids + 2 * num;
    uint8_t *digests = PyMem_Calloc(32 * (size_t)num + 1, 1);
    Py_ssize_t num_taken = 0, num_skipped = 0, num_removed = 0;
    if (taken_ids == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    long block = PyLong_AsLong(PyList_GET_ITEM(next, sentinel));
    while (num_taken < num) {
        if (block < 0 || block >= sentinel) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "free blocks left, but each is a cached block's parent");
            goto done;
        }
        PyObject *following_id = PyList_GET_ITEM(next, block), *before_id = PyList_GET_ITEM(prev, block);
        long following = PyLong_AsLong(following_id), before = PyLong_AsLong(before_id);
        if (PyErr_Occurred() || following < 0 || following > sentinel || before < 0 || before > sentinel) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "the free queue links a block outside the pool");
            goto done;
        }
        if (ix->num_children[block] > 0) {
            skipped[num_skipped++] = (int32_t)block;
            block = following;
            continue;
        }
        Py_INCREF(following_id); /* unlinked, as the pool's _unlink does (SetItem takes these references) */
        Py_INCREF(before_id);
        PyList_SetItem(next, before, following_id);
        PyList_SetItem(prev, following, before_id);
        int64_t parent = -2; /* NOT_HELD: the block held no digest */
        if (ix->slot_of_block[block] >= 0) {
            if (ix->parents[block] != NO_BLOCK)
                block_index_digest_of(ix, ix->parents[block], digests + 16 * (num + num_taken));
            parent = block_index_remove_block(ix, block, digests + 16 * num_taken);
            num_removed++;
        }
        taken_ids[num_taken] = (int32_t)block;
        parent_ids[num_taken++] = (int32_t)parent;
        block = following;
        if (parent >= 0 && ix->num_children[parent] == 0) /* a leaf now: if passed over, start over */
            for (Py_ssize_t s = 0; s < num_skipped; s++)
                if (skipped[s] == parent) {
                    num_skipped = 0;
                    block = PyLong_AsLong(PyList_GET_ITEM(next, sentinel));
                    break;
                }
    }
    taken = PyList_New(num);
    parents = PyList_New(num);
    if (taken == NULL || parents == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < num; i++) {
        PyObject *id = PyList_GET_ITEM(ids, taken_ids[i]), *p = PyLong_FromLong(parent_ids[i]);
        if (p == NULL)
            goto done; /* the lists' unset items are NULL, which their deallocation skips */
        Py_INCREF(id);
        PyList_SET_ITEM(taken, i, id);
        PyList_SET_ITEM(parents, i, p);
    }
    result = Py_BuildValue("(OOy#y#n)", taken, parents, (const char *)digests, 16 * num,
                           (const char *)digests + 16 * num, 16 * num, num_removed);
done:
    Py_XDECREF(taken);
    Py_XDECREF(parents);
    PyMem_Free(taken_ids);
    PyMem_Free(digests);
    return result;
}

/* check(ix) -> 0 when every invariant holds, else block_index_check's negative code */
static PyObject *py_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(1, "check(ix)");
    block_index_t *ix = index_at(args[0]);
    return ix == NULL ? NULL : PyLong_FromLongLong(block_index_check(ix));
}

#define METHOD(name, doc) {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, doc}
static PyMethodDef methods[] = {
    METHOD(find, "The block holding a digest, or -1."),
    METHOD(digest_of, "A block's digest, or None."),
    METHOD(add_run, "Record a run of new digests, chained, all or none."),
    METHOD(remove_block, "Forget a block's digest and links."),
    METHOD(remove_blocks, "Forget several blocks' digests, in order."),
    METHOD(count_held, "How many leading blocks still hold their digests."),
    METHOD(chain, "The blocks of a chain, from its last block up."),
    METHOD(take_free, "Take free blocks from the head of the pool's queue, their digests forgotten."),
    METHOD(check, "0 when the records are consistent."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmesh_block_index", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmesh_block_index(void) { return PyModule_Create(&module); }
