/* kvmesh_chain_search: where a chain's holder sets change, searched in C (a CPython extension).
 *
 * The mirror keeps, per block key, the number of the block's interned holder set in a KeyMap
 * (metadata/key_map.py: 16-byte slots [key, value], EMPTY 0, TOMBSTONE 1, keys < 2 stored + 2,
 * home slot (key * multiplier) >> shift, linear probing). Nodes hold prefixes of chains, so along a
 * chain the holder set only shrinks: where the set numbers at two positions are equal, they are
 * equal between them, and a binary search finds every position where the number changes with a
 * probe per step. The GIL is held throughout: the mirror's writer cannot change the map mid-search.
 *
 * change_points(hashes: list[bytes], slots: uint64 buffer, mask: int, shift: int, multiplier: int,
 *               guesses: tuple[int, ...] = ())
 *   -> (positions, numbers), two tuples: position 0 and the number of block 0 first, then each
 *   position whose number differs from the one before it, in order; both empty when block 0 has no
 *   holder. A digest's first 8 bytes,
 *   little-endian, are its key. ``guesses``: positions where a change was found last time (the same
 *   first block: a shared prefix); a search splits there first, so a right guess costs two probes
 *   instead of a whole binary search, and a wrong one changes nothing but the order of the probes.
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

static PyObject *change_points(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 5 || nargs > 6 || !PyList_Check(args[0]) || (nargs == 6 && !PyTuple_Check(args[5]))) {
        PyErr_SetString(PyExc_TypeError, "change_points(hashes: list, slots, mask, shift, multiplier, guesses: tuple = ())");
        return NULL;
    }
    search_t s; /* the point and guess arrays stay unwritten past what is used */
    s.num_guesses = s.num_points = 0;
    for (Py_ssize_t g = 0; nargs == 6 && g < PyTuple_GET_SIZE(args[5]) && s.num_guesses < 64; g++) {
        Py_ssize_t p = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[5], g));
        if (p == -1 && PyErr_Occurred())
            return NULL;
        s.guesses[s.num_guesses++] = p;
    }
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
    uint64_t first, last;
    int rc = 0;
    if (n > 0) {
        rc = number_at(&s, 0, &first);
        if (rc == 0 && first != 0) {
            rc = emit(&s, 0, first);
            if (rc == 0)
                rc = number_at(&s, n - 1, &last);
            if (rc == 0 && n > 1)
                rc = search(&s, 0, first, n - 1, last);
        }
    }
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    PyObject *positions = PyTuple_New(s.num_points), *numbers = PyTuple_New(s.num_points);
    for (Py_ssize_t i = 0; positions != NULL && numbers != NULL && i < s.num_points; i++) {
        PyObject *p = PyLong_FromSsize_t(s.positions[i]), *k = PyLong_FromUnsignedLongLong(s.numbers[i]);
        if (p == NULL || k == NULL) {
            Py_XDECREF(p);
            Py_XDECREF(k);
            Py_CLEAR(positions);
            break;
        }
        PyTuple_SET_ITEM(positions, i, p);
        PyTuple_SET_ITEM(numbers, i, k);
    }
    if (positions == NULL || numbers == NULL) {
        Py_XDECREF(positions);
        Py_XDECREF(numbers);
        return NULL;
    }
    return Py_BuildValue("(NN)", positions, numbers);
}

static PyMethodDef methods[] = {
    {"change_points", (PyCFunction)(void (*)(void))change_points, METH_FASTCALL,
     "Positions where a chain's holder-set number changes (see the file's comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmesh_chain_search", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvmesh_chain_search(void) { return PyModule_Create(&module); }
