/* kvtierd.eviction._stamps: an LRU's batch of touches, inserts or removals, in one C loop each.
 *
 * Why: LRUPolicy (kvtierd/eviction/lru.py) keeps a 32-bit stamp (the slot's position in its
 * access log) and a membership byte per slot; every GET and LOOKUP batch touches its hits, every
 * PUT inserts its commits and every DELETE removes its chunks, slot by slot. As Python loops that
 * was ~0.1 us per slot of the request loop's time. lru.py keeps the Python forms these are tested
 * against (tests/unit/kvtierd/eviction/test_lru.py runs every test with both) and runs them where
 * this extension was not built.
 *
 * A rewrite (the log's garbage dropped, positions renumbered from 0) is three more loops here:
 * in Python it read every log entry as an int object, ~0.2 s of the request loop at a million
 * chunks, and a few percent of a PUT's loop time at 16 KiB (issue 12).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* One call's view of the policy's per-slot columns (the stamps, array 'I', and the membership
 * bytes) and of its batch of slots. */
typedef struct {
    Py_buffer stamp, member;
    uint32_t *stamps;
    unsigned char *members;
    Py_ssize_t slots;  /* the slots both columns cover */
    PyObject *fast;    /* the batch, as a list or tuple */
    PyObject **items;
    Py_ssize_t n;
} lru_batch;

static int lru_batch_of(PyObject *stamp, PyObject *member, PyObject *slots, lru_batch *out) {
    if (PyObject_GetBuffer(stamp, &out->stamp, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (out->stamp.itemsize != 4 || out->stamp.format == NULL ||
        strchr("IL", out->stamp.format[0]) == NULL) {
        PyErr_Format(PyExc_TypeError, "stamp must be an array of 32-bit unsigned ints (format "
                     "'I'), not of format %s", out->stamp.format ? out->stamp.format : "B");
        PyBuffer_Release(&out->stamp);
        return -1;
    }
    if (PyObject_GetBuffer(member, &out->member, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&out->stamp);
        return -1;
    }
    out->fast = PySequence_Fast(slots, "slots must be a list or tuple of ints");
    if (out->fast == NULL) {
        PyBuffer_Release(&out->stamp);
        PyBuffer_Release(&out->member);
        return -1;
    }
    Py_ssize_t stamps = out->stamp.len / 4;
    out->slots = out->member.len < stamps ? out->member.len : stamps;
    out->stamps = out->stamp.buf;
    out->members = out->member.buf;
    out->items = PySequence_Fast_ITEMS(out->fast);
    out->n = PySequence_Fast_GET_SIZE(out->fast);
    return 0;
}

static void lru_batch_release(lru_batch *batch) {
    PyBuffer_Release(&batch->stamp);
    PyBuffer_Release(&batch->member);
    Py_DECREF(batch->fast);
}

/* The batch's i-th slot if it is a member, else -1 (not an int >= 0, past the columns, or not a
 * member): what the policy's Python loops treat as "not a member". */
static Py_ssize_t member_at(const lru_batch *batch, Py_ssize_t i) {
    PyObject *item = batch->items[i];
    Py_ssize_t slot = PyLong_Check(item) ? PyLong_AsSsize_t(item) : -1;
    if (slot == -1 && PyErr_Occurred()) {
        PyErr_Clear();  /* beyond any column */
    }
    return slot >= 0 && slot < batch->slots && batch->members[slot] ? slot : -1;
}

/* A position that fits a 32-bit stamp, for every one of n slots from start. */
static int positions_fit(unsigned long long start, Py_ssize_t n) {
    if (start + (unsigned long long)n > 0xFFFFFFFFull) {
        PyErr_Format(PyExc_OverflowError, "positions %llu.. for %zd slots do not fit 32 bits",
                     start, n);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(stamp_members_doc,
"stamp_members(stamp, member, slots, start) -> int\n--\n\n"
"stamp[slots[i]] = start + i for the leading slots that are members (member[slot] != 0); stops\n"
"at the first that is not, or is out of range or not an int >= 0. Returns how many it stamped\n"
"(an LRU's batch of touches: kvtierd/eviction/lru.py).");

static PyObject *stamp_members(PyObject *self, PyObject *args) {
    PyObject *stamp, *member, *slots;
    unsigned long long start;
    lru_batch batch;
    if (!PyArg_ParseTuple(args, "OOOK:stamp_members", &stamp, &member, &slots, &start) ||
        lru_batch_of(stamp, member, slots, &batch) < 0) {
        return NULL;
    }
    Py_ssize_t done = 0;
    if (positions_fit(start, batch.n)) {
        for (Py_ssize_t slot; done < batch.n && (slot = member_at(&batch, done)) >= 0; done++) {
            batch.stamps[slot] = (uint32_t)(start + (unsigned long long)done);
        }
    }
    lru_batch_release(&batch);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(done);
}

PyDoc_STRVAR(stamp_inserted_doc,
"stamp_inserted(stamp, member, slots, start) -> int\n--\n\n"
"member[slots[i]] = 1 and stamp[slots[i]] = start + i for every i (a slot twice: the later\n"
"position wins); every slot is checked to be in range first. Returns how many were not members\n"
"before (an LRU's batch of inserts).");

static PyObject *stamp_inserted(PyObject *self, PyObject *args) {
    PyObject *stamp, *member, *slots;
    unsigned long long start;
    lru_batch batch;
    if (!PyArg_ParseTuple(args, "OOOK:stamp_inserted", &stamp, &member, &slots, &start) ||
        lru_batch_of(stamp, member, slots, &batch) < 0) {
        return NULL;
    }
    Py_ssize_t i = 0, new = -1;
    for (; i < batch.n; i++) {  /* every slot checked before anything is written */
        Py_ssize_t slot = PyLong_AsSsize_t(batch.items[i]);
        if (slot == -1 && PyErr_Occurred()) {
            break;
        }
        if (slot < 0 || slot >= batch.slots) {
            PyErr_Format(PyExc_IndexError, "slots[%zd] is %zd; the policy has %zd slots", i, slot,
                         batch.slots);
            break;
        }
    }
    if (i == batch.n && positions_fit(start, batch.n)) {
        new = 0;
        for (i = 0; i < batch.n; i++) {
            Py_ssize_t slot = PyLong_AsSsize_t(batch.items[i]);
            new += !batch.members[slot];
            batch.members[slot] = 1;
            batch.stamps[slot] = (uint32_t)(start + (unsigned long long)i);
        }
    }
    lru_batch_release(&batch);
    return new < 0 ? NULL : PyLong_FromSsize_t(new);
}

PyDoc_STRVAR(unstamp_members_doc,
"unstamp_members(stamp, member, slots, none) -> int\n--\n\n"
"stamp[slot] = none and member[slot] = 0 for every slot that is a member (others, and slots out\n"
"of range, are left alone). Returns how many were members (an LRU's batch of removals).");

static PyObject *unstamp_members(PyObject *self, PyObject *args) {
    PyObject *stamp, *member, *slots;
    unsigned int none;
    lru_batch batch;
    if (!PyArg_ParseTuple(args, "OOOI:unstamp_members", &stamp, &member, &slots, &none) ||
        lru_batch_of(stamp, member, slots, &batch) < 0) {
        return NULL;
    }
    Py_ssize_t removed = 0;
    for (Py_ssize_t i = 0; i < batch.n; i++) {
        Py_ssize_t slot = member_at(&batch, i);
        if (slot >= 0) {
            batch.stamps[slot] = none;
            batch.members[slot] = 0;
            removed++;
        }
    }
    lru_batch_release(&batch);
    return PyLong_FromSsize_t(removed);
}

/* A 32-bit unsigned column (array 'I'), writable if asked: the stamps, the log, a partition's
 * positions, a batch of slots. */
static int u32_column(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (view->itemsize != 4 || view->format == NULL || strchr("IL", view->format[0]) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be an array of 32-bit unsigned ints (format 'I'), "
                     "not of format %s", what, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(live_entries_doc,
"live_entries(log, stamp, positions, head) -> bytes\n--\n\n"
"The live entries of an LRU's log, in order, as 32-bit slots (array('I').frombytes): with\n"
"positions None, log[pos] for every pos >= head whose slot's stamp is pos; else, for every\n"
"position p in positions[head:] (a partition's log of positions into the main one), log[p]\n"
"where its slot's stamp is p. A position past the log or a slot past the stamps is garbage.\n"
"What a rewrite keeps (kvtierd/eviction/lru.py).");

static PyObject *live_entries(PyObject *self, PyObject *args) {
    PyObject *log, *stamp, *positions;
    Py_ssize_t head;
    Py_buffer lv, sv, pv = {0};
    if (!PyArg_ParseTuple(args, "OOOn:live_entries", &log, &stamp, &positions, &head)) {
        return NULL;
    }
    if (u32_column(log, &lv, 0, "log") < 0) {
        return NULL;
    }
    if (u32_column(stamp, &sv, 0, "stamp") < 0) {
        PyBuffer_Release(&lv);
        return NULL;
    }
    int by_position = positions != Py_None;
    if (by_position && u32_column(positions, &pv, 0, "positions") < 0) {
        PyBuffer_Release(&lv);
        PyBuffer_Release(&sv);
        return NULL;
    }
    const uint32_t *logs = lv.buf, *stamps = sv.buf, *at = by_position ? pv.buf : NULL;
    Py_ssize_t nlog = lv.len / 4, nstamp = sv.len / 4;
    Py_ssize_t end = by_position ? pv.len / 4 : nlog;
    Py_ssize_t first = head < 0 ? 0 : (head > end ? end : head);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (end - first) * 4);
    if (out != NULL) {
        uint32_t *kept = (uint32_t *)PyBytes_AS_STRING(out);
        Py_ssize_t n = 0;
        for (Py_ssize_t i = first; i < end; i++) {
            Py_ssize_t pos = by_position ? (Py_ssize_t)at[i] : i;
            if (pos >= nlog) {
                continue;
            }
            uint32_t slot = logs[pos];
            if ((Py_ssize_t)slot < nstamp && stamps[slot] == (uint32_t)pos) {
                kept[n++] = slot;
            }
        }
        _PyBytes_Resize(&out, n * 4);
    }
    PyBuffer_Release(&lv);
    PyBuffer_Release(&sv);
    if (by_position) {
        PyBuffer_Release(&pv);
    }
    return out;
}

/* The stamps (writable if asked) and a batch of slots, every slot checked to be a slot of the
 * stamps before anything is read or written: 0, or -1 with an exception set and nothing held. */
static int stamps_and_slots(PyObject *args, const char *format, int writable, Py_buffer *sv,
                            Py_buffer *lv) {
    PyObject *stamp, *slots;
    if (!PyArg_ParseTuple(args, format, &stamp, &slots)) {
        return -1;
    }
    if (u32_column(stamp, sv, writable, "stamp") < 0) {
        return -1;
    }
    if (u32_column(slots, lv, 0, "slots") < 0) {
        PyBuffer_Release(sv);
        return -1;
    }
    const uint32_t *at = lv->buf;
    Py_ssize_t n = lv->len / 4, nstamp = sv->len / 4;
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((Py_ssize_t)at[i] >= nstamp) {
            PyErr_Format(PyExc_IndexError, "slots[%zd] is %u; the policy has %zd slots", i, at[i],
                         nstamp);
            PyBuffer_Release(sv);
            PyBuffer_Release(lv);
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(renumber_doc,
"renumber(stamp, slots) -> None\n--\n\n"
"stamp[slots[i]] = i for every i (slots: array('I'), the live log a rewrite kept); every slot\n"
"is checked to be in range first, so a bad one writes nothing.");

static PyObject *renumber(PyObject *self, PyObject *args) {
    Py_buffer sv, lv;
    if (stamps_and_slots(args, "OO:renumber", 1, &sv, &lv) < 0) {
        return NULL;
    }
    uint32_t *stamps = sv.buf;
    const uint32_t *at = lv.buf;
    for (Py_ssize_t i = 0, n = lv.len / 4; i < n; i++) {
        stamps[at[i]] = (uint32_t)i;
    }
    PyBuffer_Release(&sv);
    PyBuffer_Release(&lv);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stamps_at_doc,
"stamps_at(stamp, slots) -> bytes\n--\n\n"
"stamp[slot] for every slot of slots (array('I')), as 32-bit values (array('I').frombytes): a\n"
"partition's new positions after a rewrite renumbered the stamps. IndexError for a slot past\n"
"the stamps.");

static PyObject *stamps_at(PyObject *self, PyObject *args) {
    Py_buffer sv, lv;
    if (stamps_and_slots(args, "OO:stamps_at", 0, &sv, &lv) < 0) {
        return NULL;
    }
    const uint32_t *stamps = sv.buf, *at = lv.buf;
    Py_ssize_t n = lv.len / 4;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out != NULL) {
        uint32_t *got = (uint32_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            got[i] = stamps[at[i]];
        }
    }
    PyBuffer_Release(&sv);
    PyBuffer_Release(&lv);
    return out;
}

static PyMethodDef methods[] = {
    {"stamp_members", stamp_members, METH_VARARGS, stamp_members_doc},
    {"stamp_inserted", stamp_inserted, METH_VARARGS, stamp_inserted_doc},
    {"unstamp_members", unstamp_members, METH_VARARGS, unstamp_members_doc},
    {"live_entries", live_entries, METH_VARARGS, live_entries_doc},
    {"renumber", renumber, METH_VARARGS, renumber_doc},
    {"stamps_at", stamps_at, METH_VARARGS, stamps_at_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "kvtierd.eviction._stamps",
    "An LRU's batch of stamps in one C loop (see kvtierd/eviction/_stamps.c).",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__stamps(void) {
    return PyModule_Create(&module);
}
