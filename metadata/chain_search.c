/* kvmesh_chain_search: where a chain's holder sets change, searched in C (a CPython extension).
 *
 * The mirror keeps, per block key, the number of the block's interned holder set in a KeyMap
 * (metadata/key_map.py: 16-byte slots [key, value], EMPTY 0, TOMBSTONE 1, keys < 2 stored + 2,
 * home slot (key * multiplier) >> shift, linear probing). Nodes hold prefixes of chains, so along a
 * chain the holder set only shrinks: where the set numbers at two positions are equal, they are
 * equal between them, and a binary search finds every position where the number changes with a
 * probe per step. The GIL is held throughout: the mirror's writer cannot change the map mid-search.
 *
 * holders(hashes: list[bytes], slots: uint64 buffer, mask: int, shift: int, multiplier: int,
 *         guesses: tuple[int, ...], set_slots: list[tuple[int, ...]], node_at: list[str | None], exclude: str)
 *   -> (lengths, changes): lengths, a dict node id -> the number of leading blocks of the chain it holds
 *   (nodes holding none, slots without a node and ``exclude`` left out); changes, the positions after 0
 *   where the chain's holder-set number changes (for the next ``guesses``). A digest's first 8 bytes,
 *   little-endian, are its key; a key's value is its holder set's number, ``set_slots[number]`` that
 *   set's node slots in ascending order (a number past the list: no holder). ``guesses``: positions
 *   where a change was found last time (the same first block: a shared prefix); a search splits there
 *   first, so a right guess costs two probes instead of a whole binary search, and a wrong one changes
 *   nothing but the order of the probes. A node's length is the position where it leaves the set.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_POINTS 1024 /* changes kept along one chain (at most one per holder); past it: OverflowError */

typedef struct {
    PyObject **items;
    const uint64_t *slots;
    uint64_t mask, multiplier;
    int shift;
    Py_ssize_t guesses[64];
    Py_ssize_t num_guesses;
    Py_ssize_t positions[MAX_POINTS];
    uint64_t numbers[MAX_POINTS];
    Py_ssize_t num_points;
} search_t;

static int number_at(search_t *s, Py_ssize_t i, uint64_t *number) {
    PyObject *digest = s->items[i];
    if (!PyBytes_Check(digest) || PyBytes_GET_SIZE(digest) < 8) {
        PyErr_Format(PyExc_TypeError, "block hash %zd is not bytes of at least 8", i);
        return -1;
    }
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(digest);
    uint64_t key = 0;
    for (int k = 7; k >= 0; k--)
        key = (key << 8) | b[k];
    if (key < 2)
        key += 2;
    uint64_t slot = (key * s->multiplier) >> s->shift;
    for (;;) {
        uint64_t found = s->slots[2 * slot];
        if (found == key) {
            *number = s->slots[2 * slot + 1];
            return 0;
        }
        if (found == 0) {
            *number = 0;
            return 0;
        }
        slot = (slot + 1) & s->mask;
    }
}

static int emit(search_t *s, Py_ssize_t position, uint64_t number) {
    if (s->num_points == MAX_POINTS) {
        PyErr_SetString(PyExc_OverflowError, "more holder-set changes along one chain than a search keeps");
        return -1;
    }
    s->positions[s->num_points] = position;
    s->numbers[s->num_points++] = number;
    return 0;
}

/* Every change in (lo, hi], given the numbers at both ends; depth is at most log2 of the chain. */
static int search(search_t *s, Py_ssize_t lo, uint64_t at_lo, Py_ssize_t hi, uint64_t at_hi) {
    if (at_lo == at_hi)
        return 0;
    if (hi - lo == 1)
        return emit(s, hi, at_hi);
    Py_ssize_t mid = lo + (hi - lo) / 2;
    for (Py_ssize_t g = 0; g < s->num_guesses; g++) {  /* a guessed change at p: split at p - 1, then at p */
        Py_ssize_t p = s->guesses[g];
        if (lo < p - 1 && p - 1 < hi) {
            mid = p - 1;
            break;
        }
        if (lo < p && p < hi) {
            mid = p;
            break;
        }
    }
    uint64_t at_mid;
    if (number_at(s, mid, &at_mid) < 0 || search(s, lo, at_lo, mid, at_mid) < 0)
        return -1;
    return search(s, mid, at_mid, hi, at_hi);
}

static int parse_guesses(search_t *s, PyObject *guesses) {
    s->num_guesses = s->num_points = 0;
    for (Py_ssize_t g = 0; g < PyTuple_GET_SIZE(guesses) && s->num_guesses < 64; g++) {
        Py_ssize_t p = PyLong_AsSsize_t(PyTuple_GET_ITEM(guesses, g));
        if (p == -1 && PyErr_Occurred())
            return -1;
        s->guesses[s->num_guesses++] = p;
    }
    return 0;
}

/* The change points of the chain (s->items, n of them) into s; the map's buffer is held by the caller. */
static int find_changes(search_t *s, Py_ssize_t n) {
    uint64_t first, last;
    if (n == 0 || number_at(s, 0, &first) < 0)
        return n == 0 ? 0 : -1;
    if (first == 0)
        return 0;
    if (emit(s, 0, first) < 0 || number_at(s, n - 1, &last) < 0)
        return -1;
    return n > 1 ? search(s, 0, first, n - 1, last) : 0;
}

/* The node slots of holder set ``number`` (an empty tuple past the list: a set renumbered meanwhile). */
static PyObject *slots_of(PyObject *set_slots, uint64_t number) {
    static PyObject *empty = NULL;
    if (number < (uint64_t)PyList_GET_SIZE(set_slots)) {
        PyObject *t = PyList_GET_ITEM(set_slots, (Py_ssize_t)number);
        if (PyTuple_Check(t))
            return t;
    }
    if (empty == NULL)
        empty = PyTuple_New(0);
    return empty;
}

/* Slot numbers of a set's tuple into out (those outside [0, limit) dropped); returns how many. */
static Py_ssize_t read_slots(PyObject *tuple, Py_ssize_t limit, Py_ssize_t *out) {
    Py_ssize_t num = 0;
    if (tuple == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++) {
        Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(tuple, i));
        if (slot == -1 && PyErr_Occurred())
            return -1;
        if (slot >= 0 && slot < limit)
            out[num++] = slot;
    }
    return num;
}

/* lengths[node_at[slot]] = length, unless the slot has no node or it is ``exclude``. */
static int name(PyObject *lengths, PyObject *node_at, Py_ssize_t slot, PyObject *exclude, Py_ssize_t length) {
    PyObject *node = PyList_GET_ITEM(node_at, slot);
    if (node == Py_None)
        return 0;
    int is_excluded = PyObject_RichCompareBool(node, exclude, Py_EQ);
    if (is_excluded != 0)
        return is_excluded < 0 ? -1 : 0;
    PyObject *value = PyLong_FromSsize_t(length);
    int rc = value == NULL ? -1 : PyDict_SetItem(lengths, node, value);
    Py_XDECREF(value);
    return rc;
}

/* Each node of the first block's set gets the position where it first leaves the set (the chain's length if
 * never): the sets of the change points are read in order, as the Python search does. */
static int name_lengths(search_t *s, Py_ssize_t n, PyObject *set_slots, PyObject *node_at, PyObject *exclude,
                        PyObject *lengths) {
    Py_ssize_t num_slots = PyList_GET_SIZE(node_at), *first = NULL, *current = NULL;
    unsigned char *state = NULL; /* per slot: 1 still holding, 2 in the current set */
    int rc = -1;
    if (s->num_points == 0 || num_slots == 0)
        return 0;
    first = PyMem_Malloc(2 * sizeof(Py_ssize_t) * (size_t)num_slots);
    state = PyMem_Calloc((size_t)num_slots, 1);
    if (first == NULL || state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    current = first + num_slots;
    Py_ssize_t num_first = read_slots(slots_of(set_slots, s->numbers[0]), num_slots, first);
    if (num_first < 0)
        goto done;
    for (Py_ssize_t f = 0; f < num_first; f++)
        state[first[f]] = 1;
    for (Py_ssize_t i = 1; i < s->num_points; i++) {
        Py_ssize_t num_current = read_slots(slots_of(set_slots, s->numbers[i]), num_slots, current);
        if (num_current < 0)
            goto done;
        for (Py_ssize_t c = 0; c < num_current; c++)
            state[current[c]] |= 2;
        for (Py_ssize_t f = 0; f < num_first; f++) {
            Py_ssize_t slot = first[f];
            if (state[slot] == 1) {
                state[slot] = 0;
                if (name(lengths, node_at, slot, exclude, s->positions[i]) < 0)
                    goto done;
            }
        }
        for (Py_ssize_t c = 0; c < num_current; c++)
            state[current[c]] &= 1;
    }
    for (Py_ssize_t f = 0; f < num_first; f++)
        if (state[first[f]] == 1 && name(lengths, node_at, first[f], exclude, n) < 0)
            goto done;
    rc = 0;
done:
    PyMem_Free(first);
    PyMem_Free(state);
    return rc;
}

static PyObject *holders(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9 || !PyList_Check(args[0]) || !PyTuple_Check(args[5]) || !PyList_Check(args[6]) ||
        !PyList_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError, "holders(hashes: list, slots, mask, shift, multiplier, guesses: tuple, "
                                         "set_slots: list, node_at: list, exclude: str)");
        return NULL;
    }
    search_t s; /* the point and guess arrays stay unwritten past what is used */
    if (parse_guesses(&s, args[5]) < 0)
        return NULL;
    s.mask = PyLong_AsUnsignedLongLong(args[2]);
    int shift = (int)PyLong_AsLong(args[3]);
    s.multiplier = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (shift < 1 || shift > 63) {
        PyErr_SetString(PyExc_ValueError, "shift out of range");
        return NULL;
    }
    s.shift = shift;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if ((uint64_t)view.len != 16 * (s.mask + 1)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "slots do not match the mask");
        return NULL;
    }
    s.slots = (const uint64_t *)view.buf;
    s.items = PySequence_Fast_ITEMS(args[0]);
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    int rc = find_changes(&s, n);
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    PyObject *lengths = PyDict_New(), *changes = PyTuple_New(s.num_points > 1 ? s.num_points - 1 : 0);
    if (lengths == NULL || changes == NULL)
        goto fail;
    for (Py_ssize_t i = 1; i < s.num_points; i++) {
        PyObject *p = PyLong_FromSsize_t(s.positions[i]);
        if (p == NULL)
            goto fail;
        PyTuple_SET_ITEM(changes, i - 1, p);
    }
    if (name_lengths(&s, n, args[6], args[7], args[8], lengths) < 0)
        goto fail;
    return Py_BuildValue("(NN)", lengths, changes);
fail:
    Py_XDECREF(lengths);
    Py_XDECREF(changes);
    return NULL;
}

static PyMethodDef methods[] = {
    {"holders", (PyCFunction)(void (*)(void))holders, METH_FASTCALL,
     "How many leading blocks of a chain each node holds (see the file's comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmesh_chain_search", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmesh_chain_search(void) { return PyModule_Create(&module); }
