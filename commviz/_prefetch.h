/* Asking for a decoded trace's events a few events ahead of the pass that reads them.
 *
 * A rank's trace decodes into about 200k dicts spread over some 300 MB. Each C pass over them
 * (``trace/_scan.c``, ``write/_emit.c``) reads a few keys of every event and, on a 2-core VM,
 * waits on memory for the event's dict and its key table longer than it computes:
 * ``time_bounds`` took 155 ns an event, a third less once the events ahead are asked for.
 * A prefetch never faults and changes nothing a pass computes; where the compiler has no
 * ``__builtin_prefetch`` these do nothing. */
#ifndef COMMVIZ_PREFETCH_H
#define COMMVIZ_PREFETCH_H

#include <Python.h>

#define PREFETCH_FAR 16     /* events ahead: the dict object itself */
#define PREFETCH_NEAR 8     /* events ahead: its key table (read from the object asked for at FAR) */
#define PREFETCH_VALUES 4   /* events ahead: its values (read from the key table asked for at NEAR) */
#define PREFETCH_ARGS 2     /* events ahead: its args' key table (the writer reads them all) */
#define PREFETCH_KEY_LINES 4    /* cache lines of a key table: an event's 8 to 10 keys */

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((const void *)(p))
#else
#define PREFETCH(p) ((void)(p))
#endif

/* The key table (where a dict keeps its keys and values) of ``o``, when it is a dict. The
 * table's address is read through a volatile pointer: GCC 12 at -O2 with NDEBUG (how Python
 * builds extensions) otherwise drops a load whose only use is a prefetch, and the
 * prefetches with it. */
static inline void prefetch_keys(PyObject *o) {
    if (o == NULL || !PyDict_CheckExact(o)) return;
    const char *keys = (const char *)*(PyDictKeysObject *volatile *)&((PyDictObject *)o)->ma_keys;
    for (int line = 0; line < PREFETCH_KEY_LINES; line++) PREFETCH(keys + 64 * line);
}

/* The value objects of ``o`` (its ts, its name, its args dict, ...), when it is a dict. */
static inline void prefetch_values(PyObject *o) {
    if (o == NULL || !PyDict_CheckExact(o)) return;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(o, &pos, &key, &value)) PREFETCH(value);
}

/* For a pass at ``list[i]``: the objects ``PREFETCH_FAR`` ahead, the key tables of those
 * ``PREFETCH_NEAR`` ahead and the values of those ``PREFETCH_VALUES`` ahead. */
static inline void prefetch_ahead(PyObject *list, Py_ssize_t i) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (i + PREFETCH_FAR < n) PREFETCH(PyList_GET_ITEM(list, i + PREFETCH_FAR));
    if (i + PREFETCH_NEAR < n) prefetch_keys(PyList_GET_ITEM(list, i + PREFETCH_NEAR));
    if (i + PREFETCH_VALUES < n) prefetch_values(PyList_GET_ITEM(list, i + PREFETCH_VALUES));
}

/* ``list[at]`` where ``at`` (an int object) indexes it, else NULL: for passes that walk the
 * events through a list of their indices. */
static inline PyObject *item_at(PyObject *list, PyObject *at) {
    if (!PyLong_CheckExact(at)) return NULL;
    Py_ssize_t k = PyLong_AsSsize_t(at);
    if (k < 0 || k >= PyList_GET_SIZE(list)) {
        PyErr_Clear();
        return NULL;
    }
    return PyList_GET_ITEM(list, k);
}

/* For a pass at ``events[indices[j]]``: as ``prefetch_ahead``, through the indices. */
static inline void prefetch_indexed(PyObject *events, PyObject *indices, Py_ssize_t j) {
    Py_ssize_t n = PyList_GET_SIZE(indices);
    if (j + PREFETCH_FAR < n) {
        PyObject *ev = item_at(events, PyList_GET_ITEM(indices, j + PREFETCH_FAR));
        if (ev != NULL) PREFETCH(ev);
    }
    if (j + PREFETCH_NEAR < n)
        prefetch_keys(item_at(events, PyList_GET_ITEM(indices, j + PREFETCH_NEAR)));
    if (j + PREFETCH_VALUES < n)
        prefetch_values(item_at(events, PyList_GET_ITEM(indices, j + PREFETCH_VALUES)));
}

#endif
