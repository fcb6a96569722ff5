/* kvmesh_block_index: the block pool's hash records (block_records.h) as a CPython extension.
 *
 * Every function takes the address of the caller's block_index_t first (the caller keeps it and the
 * arrays it points into alive), holds the GIL (one call is atomic for Python threads) and reads the
 * caller's lists of digests and block ids in place. kvmesh/kv/block_index.py's NativeBlockIndex is the
 * Python side; its DictBlockIndex gives the same answers without this.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "block_records.h"

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

/* take_free(ix, next, prev, ids, num, ref, epoch, with_hashes) -> (taken, parents, hashes, parent_hashes,
 * num_removed): allocation from the pool's free queue in one call. Unlinks the num least recently used free
 * blocks that are no cached block's parent from the queue (the Python lists next / prev, sentinel at index
 * num_blocks, their items the pool's id objects) and forgets their digests as they go, so a parent whose
 * children were all taken becomes a leaf (the walk then starts over from the head if it passed that parent):
 * what taking them one by one from the head gives. Each block taken gets ref[block] = 1 and epoch[block] + 1.
 * taken holds the pool's id objects in ascending order; parents, hashes and parent_hashes are remove_blocks's
 * answer in the order taken (a parent after its children), the digests left empty unless with_hashes.
 * RuntimeError when the queue runs out first (the caller checked there are num free blocks: that every block
 * left is a cached block's parent cannot be). */
static int compare_ids(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* ids in ascending order: insertion sort, allocations being short (a long one still sorts in place) */
static void sort_ids(int32_t *ids, Py_ssize_t n) {
    if (n > 64) {
        qsort(ids, (size_t)n, sizeof *ids, compare_ids);
        return;
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        int32_t v = ids[i];
        Py_ssize_t j = i;
        for (; j > 0 && ids[j - 1] > v; j--)
            ids[j] = ids[j - 1];
        ids[j] = v;
    }
}

static PyObject *py_take_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS(8, "take_free(ix, next, prev, ids, num, ref, epoch, with_hashes)");
    block_index_t *ix = index_at(args[0]);
    PyObject *next = args[1], *prev = args[2], *ids = args[3], *ref = args[5], *epoch = args[6];
    Py_ssize_t num = PyLong_AsSsize_t(args[4]);
    int with_hashes = PyObject_IsTrue(args[7]);
    if (ix == NULL || (num == -1 && PyErr_Occurred()) || with_hashes < 0)
        return NULL;
    const Py_ssize_t sentinel = ix->num_blocks;
    if (!PyList_Check(next) || !PyList_Check(prev) || !PyList_Check(ids) || !PyList_Check(ref) ||
        !PyList_Check(epoch) || PyList_GET_SIZE(next) != sentinel + 1 || PyList_GET_SIZE(prev) != sentinel + 1 ||
        PyList_GET_SIZE(ids) != sentinel || PyList_GET_SIZE(ref) != sentinel || PyList_GET_SIZE(epoch) != sentinel ||
        num < 0 || num > sentinel) {
        PyErr_SetString(PyExc_ValueError, "take_free: the pool's queue lists (num_blocks + 1), its ids, ref counts "
                        "and epochs (num_blocks), 0 <= num");
        return NULL;
    }
    PyObject *taken = NULL, *parents = NULL, *result = NULL;
    int32_t *taken_ids = PyMem_Malloc(sizeof(int32_t) * 2 * (size_t)num + 1), *parent_ids = taken_ids + num;
    int32_t stack_skipped[64], *skipped = stack_skipped; /* parents passed over: few, grown when not */
    Py_ssize_t skipped_capacity = 64;
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
            if (num_skipped == skipped_capacity) {
                int32_t *grown = PyMem_Malloc(sizeof(int32_t) * 2 * (size_t)skipped_capacity);
                if (grown == NULL) {
                    PyErr_NoMemory();
                    goto done;
                }
                memcpy(grown, skipped, sizeof(int32_t) * (size_t)num_skipped);
                if (skipped != stack_skipped)
                    PyMem_Free(skipped);
                skipped = grown;
                skipped_capacity *= 2;
            }
            skipped[num_skipped++] = (int32_t)block;
            block = following;
            continue;
        }
        Py_INCREF(following_id); /* unlinked, as the pool's _unlink does (SetItem takes these references) */
        Py_INCREF(before_id);
        PyList_SetItem(next, before, following_id);
        PyList_SetItem(prev, following, before_id);
        int64_t parent = block_index_remove_reporting(ix, block, digests + 16 * num_taken,
                                                      digests + 16 * (num + num_taken)); /* -2: it held none */
        num_removed += parent >= NO_BLOCK;
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
    PyObject *one = PyLong_FromLong(1);
    for (Py_ssize_t i = 0; i < num; i++) { /* the references and epochs, then the parents in the order taken */
        long long times = PyLong_AsLongLong(PyList_GET_ITEM(epoch, taken_ids[i]));
        PyObject *p = PyLong_FromLong(parent_ids[i]);
        PyObject *bumped = times == -1 && PyErr_Occurred() ? NULL : PyLong_FromLongLong(times + 1);
        if (p == NULL || bumped == NULL) {
            Py_XDECREF(p);
            Py_XDECREF(bumped);
            Py_DECREF(one);
            goto done; /* the lists' unset items are NULL, which their deallocation skips */
        }
        PyList_SetItem(epoch, taken_ids[i], bumped);
        Py_INCREF(one);
        PyList_SetItem(ref, taken_ids[i], one);
        PyList_SET_ITEM(parents, i, p);
    }
    Py_DECREF(one);
    sort_ids(taken_ids, num);
    for (Py_ssize_t i = 0; i < num; i++) {
        PyObject *id = PyList_GET_ITEM(ids, taken_ids[i]);
        Py_INCREF(id);
        PyList_SET_ITEM(taken, i, id);
    }
    Py_ssize_t digest_bytes = with_hashes ? 16 * num : 0;
    PyObject *hashes = PyBytes_FromStringAndSize((const char *)digests, digest_bytes);
    PyObject *parent_hashes = PyBytes_FromStringAndSize((const char *)digests + 16 * num, digest_bytes);
    PyObject *count = PyLong_FromSsize_t(num_removed);
    if (hashes != NULL && parent_hashes != NULL && count != NULL)
        result = PyTuple_Pack(5, taken, parents, hashes, parent_hashes, count);
    Py_XDECREF(hashes);
    Py_XDECREF(parent_hashes);
    Py_XDECREF(count);
done:
    Py_XDECREF(taken);
    Py_XDECREF(parents);
    PyMem_Free(taken_ids);
    PyMem_Free(digests);
    if (skipped != stack_skipped)
        PyMem_Free(skipped);
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
