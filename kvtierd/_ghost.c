/* kvtierd._ghost: the capacity-planning ghosts' keys-only LRU (kvtierd/ghost.py), in C.
 *
 * Why: every PUT batch inserts its keys into each ghost of every tier, every GET batch touches
 * them and every DELETE removes them. As an OrderedDict (one heap node per key) that was about a
 * tenth of the request loop's CPU per 16 KiB PUT item, and ~140 bytes a key. Here a ghost is flat
 * arrays: per key a 64-bit key, a page count and two 32-bit links of the recency list, found
 * through an open-addressing table of 32-bit node numbers (linear probing, backward-shift
 * deletion: no tombstones), about 40 bytes a key. ghost.py keeps the Python form this is tested
 * against (tests/unit/kvtierd/test_ghost.py runs every test with both) and runs it where this
 * extension was not built.
 *
 * Semantics, exactly those of the Python form: insert(key, pages) drops the key's old entry, then
 * (unless pages exceed the whole capacity) appends it as the most recent and evicts the coldest
 * keys while the pages held exceed the capacity; access(key) makes a held key the most recent.
 * Keys are the ghosts' 64-bit hashes (Python ints 0 <= key < 2**64).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define NONE (-1)
#define MAX_NODES 0x3FFFFFFF /* node numbers and table sizes stay well inside int32 */

typedef struct {
    uint64_t key, pages;
    int32_t prev;  /* the next colder node, NONE for the coldest */
    int32_t next;  /* the next more recent node (or the next free node) */
} Node;

typedef struct {
    PyObject_HEAD
    long long capacity_pages;
    long long page_bytes;
    long long used_pages;
    Node *node;         /* the nodes, by number */
    int32_t nodes;      /* nodes allocated in the arrays */
    int32_t count;      /* keys held */
    int32_t free_head;  /* free nodes, linked through next */
    int32_t coldest, hottest;
    int32_t *table;     /* node number or NONE; size a power of two, at most half full */
    uint32_t table_bits;
} Ghost;

static inline size_t slot_of(const Ghost *g, uint64_t key) {
    /* Fibonacci hashing: the keys are hashes already, but a caller's keys need not be */
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - g->table_bits));
}

#define table_mask(g) (((size_t)1 << (g)->table_bits) - 1)

/* The table slot holding key's node, or the empty slot where it would go. */
static size_t find_slot(const Ghost *g, uint64_t key) {
    size_t mask = table_mask(g), slot = slot_of(g, key);
    while (g->table[slot] != NONE && g->node[g->table[slot]].key != key) {
        slot = (slot + 1) & mask;
    }
    return slot;
}

static int32_t find(const Ghost *g, uint64_t key) {
    return g->table[find_slot(g, key)];
}

/* Empty ``slot`` and shift later members of its probe run back, so every key stays reachable
 * from its home slot without passing an empty one. */
static void table_delete_slot(Ghost *g, size_t slot) {
    size_t mask = table_mask(g), hole = slot, probe = slot;
    for (;;) {
        probe = (probe + 1) & mask;
        int32_t node = g->table[probe];
        if (node == NONE) {
            break;
        }
        size_t home = slot_of(g, g->node[node].key);
        /* the member may fill the hole unless its home lies cyclically in (hole, probe] */
        int stays = hole <= probe ? (hole < home && home <= probe) : (hole < home || home <= probe);
        if (!stays) {
            g->table[hole] = node;
            hole = probe;
        }
    }
    g->table[hole] = NONE;
}

static int table_resize(Ghost *g, uint32_t bits) {
    size_t size = (size_t)1 << bits;
    int32_t *table = PyMem_Malloc(size * sizeof(int32_t));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(table, 0xFF, size * sizeof(int32_t)); /* every slot NONE */
    PyMem_Free(g->table);
    g->table = table;
    g->table_bits = bits;
    for (int32_t node = g->coldest; node != NONE; node = g->node[node].next) {
        g->table[find_slot(g, g->node[node].key)] = node;
    }
    return 0;
}

static int grow_nodes(Ghost *g) {
    int32_t old = g->nodes;
    if (old >= MAX_NODES) {
        PyErr_Format(PyExc_MemoryError, "a ghost holds at most %d keys", MAX_NODES);
        return -1;
    }
    int32_t nodes = old ? (old > MAX_NODES / 2 ? MAX_NODES : old * 2) : 64;
    Node *grown = PyMem_Realloc(g->node, (size_t)nodes * sizeof(Node));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    g->node = grown;
    for (int32_t node = nodes - 1; node >= old; node--) {
        g->node[node].next = g->free_head;
        g->free_head = node;
    }
    g->nodes = nodes;
    return 0;
}

static void unlink_node(Ghost *g, int32_t node) {
    int32_t p = g->node[node].prev, n = g->node[node].next;
    if (p == NONE) g->coldest = n; else g->node[p].next = n;
    if (n == NONE) g->hottest = p; else g->node[n].prev = p;
}

static void append_node(Ghost *g, int32_t node) {
    g->node[node].prev = g->hottest;
    g->node[node].next = NONE;
    if (g->hottest == NONE) g->coldest = node; else g->node[g->hottest].next = node;
    g->hottest = node;
}

/* Drop the key held in ``slot`` (its node number); its node goes back to the free list. */
static void drop_at(Ghost *g, size_t slot) {
    int32_t node = g->table[slot];
    unlink_node(g, node);
    table_delete_slot(g, slot);
    g->used_pages -= (long long)g->node[node].pages;
    g->node[node].next = g->free_head;
    g->free_head = node;
    g->count--;
}

static int ghost_insert(Ghost *g, uint64_t key, uint64_t pages) {
    size_t slot = find_slot(g, key);
    int shifted = g->table[slot] != NONE; /* the old entry's removal moves others: look again */
    if (shifted) {
        drop_at(g, slot);
    }
    if (pages > (uint64_t)g->capacity_pages) {
        return 0; /* larger than the whole ghost: the real tier would refuse it too */
    }
    if (g->free_head == NONE && grow_nodes(g) < 0) {
        return -1;
    }
    if (((size_t)g->count + 1) * 2 > ((size_t)1 << g->table_bits)) {
        if (table_resize(g, g->table_bits + 1) < 0) {
            return -1;
        }
        shifted = 1;
    }
    int32_t node = g->free_head;
    g->free_head = g->node[node].next;
    g->node[node].key = key;
    g->node[node].pages = pages;
    g->table[shifted ? find_slot(g, key) : slot] = node;
    append_node(g, node);
    g->count++;
    g->used_pages += (long long)pages;
    while (g->used_pages > g->capacity_pages) {
        drop_at(g, find_slot(g, g->node[g->coldest].key));
    }
    return 0;
}

static int ghost_access(Ghost *g, uint64_t key) {
    int32_t node = find(g, key);
    if (node == NONE) {
        return 0;
    }
    if (node != g->hottest) {
        unlink_node(g, node);
        append_node(g, node);
    }
    return 1;
}

static int ghost_remove(Ghost *g, uint64_t key) {
    size_t slot = find_slot(g, key);
    if (g->table[slot] == NONE) {
        return 0;
    }
    drop_at(g, slot);
    return 1;
}

/* An int 0 <= value < 2**64 (``what``: a ghost key, a 64-bit hash, or a page count); -1 with an
 * exception naming the value otherwise. */
static int u64_of(PyObject *obj, const char *what, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "ghost %s must be an int, not %.80s", what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_OverflowError, "ghost %s must be an int 0 <= %s < 2**64, not %R", what,
                     what, obj);
        return -1;
    }
    *out = value;
    return 0;
}

#define key_of(obj, out) u64_of((obj), "key", (out))
#define pages_of(obj, out) u64_of((obj), "pages", (out))

/* -- the Python type --------------------------------------------------------------------------- */

static int Ghost_init(Ghost *g, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"capacity_bytes", "page_bytes", NULL};
    long long capacity_bytes, page_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LL:LRU", names, &capacity_bytes,
                                     &page_bytes)) {
        return -1;
    }
    if (page_bytes <= 0 || capacity_bytes < 0 || g->table != NULL) {
        PyErr_Format(PyExc_ValueError, g->table ? "a ghost is initialised once"
                     : "a ghost needs page_bytes > 0 and capacity_bytes >= 0, not %lld and %lld",
                     page_bytes, capacity_bytes);
        return -1;
    }
    g->capacity_pages = capacity_bytes / page_bytes;
    g->page_bytes = page_bytes;
    g->free_head = g->coldest = g->hottest = NONE;  /* the rest is zero from tp_new */
    return table_resize(g, 6);
}

static void Ghost_dealloc(Ghost *g) {
    PyMem_Free(g->node);
    PyMem_Free(g->table);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static int ready(Ghost *g) {
    if (g->table == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the ghost was not initialised");
        return 0;
    }
    return 1;
}

static Py_ssize_t Ghost_len(Ghost *g) {
    return g->count;
}

static int Ghost_contains(Ghost *g, PyObject *obj) {
    uint64_t key;
    if (!ready(g) || key_of(obj, &key) < 0) {
        return -1;
    }
    return find(g, key) != NONE;
}

static PyObject *Ghost_access(Ghost *g, PyObject *obj) {
    uint64_t key;
    if (!ready(g) || key_of(obj, &key) < 0) {
        return NULL;
    }
    return PyBool_FromLong(ghost_access(g, key));
}

/* ``op`` of every key of ``obj`` (a sequence or iterable), in order; the sum of its answers. */
static Py_ssize_t each_key(Ghost *g, PyObject *obj, int (*op)(Ghost *, uint64_t)) {
    PyObject *fast = ready(g) ? PySequence_Fast(obj, "keys must be an iterable of ints") : NULL;
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), sum = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key;
        if (key_of(items[i], &key) < 0) {
            sum = -1;
            break;
        }
        sum += op(g, key);
    }
    Py_DECREF(fast);
    return sum;
}

static PyObject *Ghost_access_many(Ghost *g, PyObject *obj) {
    Py_ssize_t hits = each_key(g, obj, ghost_access);
    return hits < 0 ? NULL : PyLong_FromSsize_t(hits);
}

/* None, or NULL where ``rc`` says the call failed (its exception is set). */
static PyObject *none_unless(Py_ssize_t rc) {
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Ghost_touch_many(Ghost *g, PyObject *obj) {
    return none_unless(each_key(g, obj, ghost_access));
}

static int insert_obj(Ghost *g, PyObject *key_obj, PyObject *pages_obj) {
    uint64_t key, pages;
    return key_of(key_obj, &key) < 0 || pages_of(pages_obj, &pages) < 0 ? -1
           : ghost_insert(g, key, pages);
}

static PyObject *Ghost_insert(Ghost *g, PyObject *args) {
    PyObject *key_obj, *pages_obj;
    if (!ready(g) || !PyArg_ParseTuple(args, "OO:insert", &key_obj, &pages_obj)) {
        return NULL;
    }
    return none_unless(insert_obj(g, key_obj, pages_obj));
}

static PyObject *Ghost_insert_many(Ghost *g, PyObject *args) {
    PyObject *keys_obj, *pages_obj, *keys, *pages = NULL;
    if (!ready(g) || !PyArg_ParseTuple(args, "OO:insert_many", &keys_obj, &pages_obj) ||
        (keys = PySequence_Fast(keys_obj, "keys must be an iterable of ints")) == NULL) {
        return NULL;
    }
    int rc = -1;
    if ((pages = PySequence_Fast(pages_obj, "pages must be an iterable of ints")) != NULL) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), m = PySequence_Fast_GET_SIZE(pages);
        PyObject **key_items = PySequence_Fast_ITEMS(keys);
        PyObject **page_items = PySequence_Fast_ITEMS(pages);
        rc = 0;
        for (Py_ssize_t i = 0; i < n && i < m && rc == 0; i++) {  /* zip: the shorter ends it */
            rc = insert_obj(g, key_items[i], page_items[i]);
        }
        Py_DECREF(pages);
    }
    Py_DECREF(keys);
    return none_unless(rc);
}

static PyObject *Ghost_remove(Ghost *g, PyObject *obj) {
    uint64_t key;
    return none_unless(!ready(g) || key_of(obj, &key) < 0 ? -1 : ghost_remove(g, key));
}

static PyObject *Ghost_remove_many(Ghost *g, PyObject *obj) {
    return none_unless(each_key(g, obj, ghost_remove));
}

static PyObject *Ghost_items(Ghost *g, PyObject *unused) {
    if (!ready(g)) {
        return NULL;
    }
    PyObject *out = PyList_New(g->count);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t i = 0;
    for (int32_t node = g->coldest; node != NONE; node = g->node[node].next, i++) {
        PyObject *pair = Py_BuildValue("(KK)", (unsigned long long)g->node[node].key,
                                       (unsigned long long)g->node[node].pages);
        if (pair == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    return out;
}

static PyObject *invariant_broken(const char *what) {
    PyErr_SetString(PyExc_AssertionError, what);
    return NULL;
}

static PyObject *Ghost_check_invariants(Ghost *g, PyObject *unused) {
    if (!ready(g)) {
        return NULL;
    }
    long long used = 0;
    int32_t seen = 0, before = NONE;
    for (int32_t node = g->coldest; node != NONE; before = node, node = g->node[node].next) {
        if (++seen > g->count || node < 0 || node >= g->nodes) {
            return invariant_broken("ghost recency list longer than its key count");
        }
        if (g->node[node].prev != before) {
            return invariant_broken("ghost recency list links disagree");
        }
        if (find(g, g->node[node].key) != node) {
            return invariant_broken("ghost key not found through its table");
        }
        used += (long long)g->node[node].pages;
    }
    if (seen != g->count || before != g->hottest) {
        return invariant_broken("ghost recency list and key count disagree");
    }
    int32_t in_table = 0;
    for (size_t slot = 0; slot <= table_mask(g); slot++) {
        in_table += g->table[slot] != NONE;
    }
    if (in_table != g->count) {
        return invariant_broken("ghost table and key count disagree");
    }
    if (used != g->used_pages) {
        return invariant_broken("ghost page count drifted");
    }
    if (g->used_pages > g->capacity_pages) {
        return invariant_broken("ghost above its capacity");
    }
    Py_RETURN_NONE;
}

static PyObject *Ghost_get_capacity_bytes(Ghost *g, void *unused) {
    return PyLong_FromLongLong(g->capacity_pages * g->page_bytes);
}

static PyMethodDef Ghost_methods[] = {
    {"access", (PyCFunction)Ghost_access, METH_O,
     "access(key) -> bool: True (and the most recent) if the ghost holds key."},
    {"access_many", (PyCFunction)Ghost_access_many, METH_O,
     "access_many(keys) -> int: access of each key, in order; how many were held."},
    {"touch_many", (PyCFunction)Ghost_touch_many, METH_O,
     "touch_many(keys): access of each key, in order, without counting."},
    {"insert", (PyCFunction)Ghost_insert, METH_VARARGS,
     "insert(key, pages): held (most recent) with pages; the coldest keys make room."},
    {"insert_many", (PyCFunction)Ghost_insert_many, METH_VARARGS,
     "insert_many(keys, pages): insert of each (key, pages), in order."},
    {"remove", (PyCFunction)Ghost_remove, METH_O, "remove(key): forgotten if held."},
    {"remove_many", (PyCFunction)Ghost_remove_many, METH_O,
     "remove_many(keys): remove of each key."},
    {"items", (PyCFunction)Ghost_items, METH_NOARGS,
     "items() -> list of (key, pages), coldest first."},
    {"check_invariants", (PyCFunction)Ghost_check_invariants, METH_NOARGS,
     "check_invariants(): AssertionError if the list, the table and the counts disagree."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Ghost_members[] = {
    {"capacity_pages", T_LONGLONG, offsetof(Ghost, capacity_pages), READONLY, NULL},
    {"page_bytes", T_LONGLONG, offsetof(Ghost, page_bytes), READONLY, NULL},
    {"used_pages", T_LONGLONG, offsetof(Ghost, used_pages), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Ghost_getset[] = {
    {"capacity_bytes", (getter)Ghost_get_capacity_bytes, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Ghost_as_sequence = {
    .sq_length = (lenfunc)Ghost_len,
    .sq_contains = (objobjproc)Ghost_contains,
};

static PyTypeObject GhostType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtierd._ghost.LRU",
    .tp_doc = PyDoc_STR("LRU(capacity_bytes, page_bytes): a keys-only LRU bounded by pages "
                        "(kvtierd.ghost.GhostLRU's compiled form)."),
    .tp_basicsize = sizeof(Ghost),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ghost_init,
    .tp_dealloc = (destructor)Ghost_dealloc,
    .tp_methods = Ghost_methods,
    .tp_members = Ghost_members,
    .tp_getset = Ghost_getset,
    .tp_as_sequence = &Ghost_as_sequence,
};

static struct PyModuleDef ghost_module = {
    PyModuleDef_HEAD_INIT, "kvtierd._ghost",
    "The capacity-planning ghosts' keys-only LRU in C (see kvtierd/ghost.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__ghost(void) {
    if (PyType_Ready(&GhostType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&ghost_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&GhostType);
    if (PyModule_AddObject(module, "LRU", (PyObject *)&GhostType) < 0) {
        Py_DECREF(&GhostType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
