/* commviz.write._emit: the pftrace writer's hot loop (``pftrace.emit_slices``) in C.
 *
 * The same loop as the Python ``emit_slices``, step for step, on the same per-sequence state
 * (interning tables, per-key caches, args plans): every cache miss, interning and plan
 * decision is still made by the Python methods (``Sequence.name``, ``Sequence.key``,
 * ``Sequence.ann_*``, ``_plan``, ``_ArgsPlan.store``), so both write the same bytes
 * (tests/test_write_emit.py compares them). What runs here is what a hit costs: the dict
 * lookups, the ids between cached runs, the varints and the packet framing, without the
 * interpreter's per-operation overhead. The wire constants come from Python (``setup``), so
 * they have one place. ``split`` is ``pftrace.python_split`` (the same tracks, the same item
 * objects on them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "../_prefetch.h"

#if !PY_LITTLE_ENDIAN
#error "commviz's C writer packs doubles as little-endian bytes"
#endif

/* constants handed over by pftrace.setup_native() */
static PyObject *k_ann, *k_te_begin, *k_te_instant, *k_ts, *k_interned, *k_track_event,
    *k_a_int, *k_a_string, *k_plan_fn, *k_dumps;
static Py_ssize_t k_plan_cache_max;
static PyObject *k_one;               /* 1, for a key's string count */
static int ready = 0;

/* interned attribute and key names */
static PyObject *s_names, *s_cats, *s_keys, *s_plans, *s_head, *s_end_hdr, *s_end_tail,
    *s_pending, *s_last_ts, *s_name, *s_cat, *s_key, *s_ann_str, *s_ann_int, *s_ann_float,
    *s_ann_value, *s_args, *s_pos, *s_ids, *s_cache, *s_next_check, *s_store, *s_empty;

/* ---- a growable byte buffer ------------------------------------------------------------ */
typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t more) {
    if (b->n + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + more) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int buf_add(Buf *b, const char *data, Py_ssize_t len) {
    if (buf_reserve(b, len) < 0) return -1;
    memcpy(b->p + b->n, data, len);
    b->n += len;
    return 0;
}

static int buf_bytes(Buf *b, PyObject *bytes) {
    return buf_add(b, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes));
}

static int varint_to(char *out, uint64_t v) {
    int n = 0;
    while (v > 0x7F) {
        out[n++] = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    out[n++] = (char)v;
    return n;
}

static int buf_varint(Buf *b, uint64_t v) {
    if (buf_reserve(b, 10) < 0) return -1;
    b->n += varint_to(b->p + b->n, v);
    return 0;
}

static int append_out(PyObject *out, const char *data, Py_ssize_t len) {
    Py_ssize_t n = PyByteArray_GET_SIZE(out);
    if (PyByteArray_Resize(out, n + len) < 0) return -1;
    memcpy(PyByteArray_AS_STRING(out) + n, data, len);
    return 0;
}

/* ---- small helpers -------------------------------------------------------------------- */
static PyObject *call_method1(PyObject *obj, PyObject *name, PyObject *arg) {
    return PyObject_CallMethodObjArgs(obj, name, arg, NULL);
}

static PyObject *call_method2(PyObject *obj, PyObject *name, PyObject *a, PyObject *b) {
    return PyObject_CallMethodObjArgs(obj, name, a, b, NULL);
}

/* dict.get(key) as a new reference, NULL with no error set when missing */
static PyObject *dget(PyObject *d, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(d, key);
    Py_XINCREF(v);
    return v;
}

/* an annotation ``_ANN + varint(len(inner)) + inner`` whose inner is ``part + payload`` */
static int add_ann(Buf *b, PyObject *part, const char *payload, Py_ssize_t plen) {
    Py_ssize_t inner = PyBytes_GET_SIZE(part) + plen;
    if (buf_bytes(b, k_ann) < 0 || buf_varint(b, (uint64_t)inner) < 0 || buf_bytes(b, part) < 0)
        return -1;
    return buf_add(b, payload, plen);
}

/* ``_ann_text(name_part, s)``: a string annotation written in place */
static int add_ann_text(Buf *b, PyObject *name_part, PyObject *s) {
    PyObject *enc = NULL;
    const char *data;
    Py_ssize_t len;
    data = PyUnicode_AsUTF8AndSize(s, &len);
    if (data == NULL) {                     /* lone surrogates: as Python's "surrogatepass" */
        PyErr_Clear();
        enc = PyUnicode_AsEncodedString(s, "utf-8", "surrogatepass");
        if (enc == NULL) return -1;
        data = PyBytes_AS_STRING(enc);
        len = PyBytes_GET_SIZE(enc);
    }
    char lv[10];
    int nl = varint_to(lv, (uint64_t)len);
    Py_ssize_t inner = PyBytes_GET_SIZE(name_part) + PyBytes_GET_SIZE(k_a_string) + nl + len;
    int rc = (buf_bytes(b, k_ann) < 0 || buf_varint(b, (uint64_t)inner) < 0
              || buf_bytes(b, name_part) < 0 || buf_bytes(b, k_a_string) < 0
              || buf_add(b, lv, nl) < 0 || buf_add(b, data, len) < 0) ? -1 : 0;
    Py_XDECREF(enc);
    return rc;
}

static int pop_ends(PyObject *out, Buf *pk, int64_t **stack, Py_ssize_t *depth, int64_t upto,
                    int all, int64_t *last, PyObject *end_hdr, PyObject *end_tail) {
    while (*depth > 0 && (all || (*stack)[*depth - 1] <= upto)) {
        int64_t t = (*stack)[--*depth];
        uint64_t d = (uint64_t)(t - *last);
        *last = t;
        char vd[10];
        int n = varint_to(vd, d);
        PyObject *hdr = PyList_GetItem(end_hdr, n);
        if (hdr == NULL) return -1;
        pk->n = 0;
        if (buf_bytes(pk, hdr) < 0 || buf_add(pk, vd, n) < 0 || buf_bytes(pk, end_tail) < 0
            || append_out(out, pk->p, pk->n) < 0)
            return -1;
    }
    return 0;
}

/* the per-arg encoding of every arg (Python's loop over ``args.items()``); each part is
 * appended to ``te`` and, when ``parts`` is given, kept in it as a bytes object */
static int encode_args(PyObject *seq, PyObject *keys, PyObject *args, Buf *te, PyObject *parts) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(args, &pos, &k, &v)) {
        PyObject *b = NULL;
        PyObject *entry = dget(keys, k);
        if (entry == NULL) {
            if (PyErr_Occurred()) return -1;
            PyObject *ks = PyObject_Str(k);
            if (ks == NULL) return -1;
            entry = call_method1(seq, s_key, ks);
            Py_DECREF(ks);
            if (entry == NULL) return -1;
        }
        if (!PyList_Check(entry) || PyList_GET_SIZE(entry) < 5) {
            Py_DECREF(entry);
            PyErr_SetString(PyExc_TypeError, "commviz: malformed annotation key entry");
            return -1;
        }
        Py_INCREF(v);
        if (PyUnicode_CheckExact(v)) {
            PyObject *cnt = PyNumber_Add(PyList_GET_ITEM(entry, 4), k_one);
            if (cnt == NULL || PyList_SetItem(entry, 4, cnt) < 0) goto fail;
            PyObject *cache = PyList_GET_ITEM(entry, 1);
            if (cache != Py_None) {
                b = dget(cache, v);
                if (b == NULL && PyErr_Occurred()) goto fail;
            }
            if (b == NULL) b = call_method2(seq, s_ann_str, entry, v);
        } else if (PyLong_CheckExact(v)) {
            PyObject *cache = PyList_GET_ITEM(entry, 2);
            int overflow = 0;
            long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (x == -1 && PyErr_Occurred()) goto fail;
            if (cache == Py_None && !overflow && x >= 0 && x < (1LL << 62)) {
                char lv[10];
                int n = varint_to(lv, (uint64_t)x);
                PyObject *part = PyList_GET_ITEM(entry, 0);
                Py_ssize_t inner = PyBytes_GET_SIZE(part) + PyBytes_GET_SIZE(k_a_int) + n;
                char hdr[10];
                int nh = varint_to(hdr, (uint64_t)inner);
                Py_ssize_t total = PyBytes_GET_SIZE(k_ann) + nh + inner;
                b = PyBytes_FromStringAndSize(NULL, total);
                if (b == NULL) goto fail;
                char *w = PyBytes_AS_STRING(b);
                memcpy(w, PyBytes_AS_STRING(k_ann), PyBytes_GET_SIZE(k_ann));
                w += PyBytes_GET_SIZE(k_ann);
                memcpy(w, hdr, nh);
                w += nh;
                memcpy(w, PyBytes_AS_STRING(part), PyBytes_GET_SIZE(part));
                w += PyBytes_GET_SIZE(part);
                memcpy(w, PyBytes_AS_STRING(k_a_int), PyBytes_GET_SIZE(k_a_int));
                w += PyBytes_GET_SIZE(k_a_int);
                memcpy(w, lv, n);
            } else {
                if (cache != Py_None) {
                    b = dget(cache, v);
                    if (b == NULL && PyErr_Occurred()) goto fail;
                }
                if (b == NULL) b = call_method2(seq, s_ann_int, entry, v);
            }
        } else if (PyList_CheckExact(v)) {
            PyObject *text = PyObject_CallOneArg(k_dumps, v);
            if (text == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto fail;
                PyErr_Clear();              /* an integer past 64 bits: as any other value */
                b = call_method2(seq, s_ann_value, entry, v);
            } else {
                PyObject *cnt = PyNumber_Add(PyList_GET_ITEM(entry, 4), k_one);
                if (cnt == NULL || PyList_SetItem(entry, 4, cnt) < 0) {
                    Py_DECREF(text);
                    goto fail;
                }
                PyObject *cache = PyList_GET_ITEM(entry, 1);
                if (cache != Py_None) {
                    b = dget(cache, text);
                    if (b == NULL && PyErr_Occurred()) {
                        Py_DECREF(text);
                        goto fail;
                    }
                }
                if (b == NULL) b = call_method2(seq, s_ann_str, entry, text);
                Py_DECREF(text);
            }
        } else if (PyFloat_CheckExact(v)) {
            b = dget(PyList_GET_ITEM(entry, 3), v);
            if (b == NULL && PyErr_Occurred()) goto fail;
            if (b == NULL) b = call_method2(seq, s_ann_float, entry, v);
        } else {
            b = call_method2(seq, s_ann_value, entry, v);
        }
        if (b == NULL) goto fail;
        if (!PyBytes_Check(b)) {
            PyErr_SetString(PyExc_TypeError, "commviz: an annotation encoded to non-bytes");
            goto fail;
        }
        if (buf_bytes(te, b) < 0 || (parts != NULL && PyList_Append(parts, b) < 0)) goto fail;
        Py_DECREF(b);
        Py_DECREF(v);
        Py_DECREF(entry);
        continue;
    fail:
        Py_XDECREF(b);
        Py_DECREF(v);
        Py_DECREF(entry);
        return -1;
    }
    return 0;
}

/* the cached path: runs[0], then per id its annotation and the next run. Returns 1 when
 * written, 0 when an id is of a type the cache does not take (te rolled back), -1 on error */
static int encode_cached(PyObject *args, PyObject *ids, PyObject *runs, Buf *te) {
    Py_ssize_t start = te->n;
    if (!PyTuple_Check(runs) || !PyList_Check(ids)
        || PyTuple_GET_SIZE(runs) != PyList_GET_SIZE(ids) + 1) {
        PyErr_SetString(PyExc_TypeError, "commviz: malformed args plan");
        return -1;
    }
    if (buf_bytes(te, PyTuple_GET_ITEM(runs, 0)) < 0) return -1;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *id = PyList_GET_ITEM(ids, j);     /* (key, p_int, p_double, p_name) */
        PyObject *v = PyDict_GetItemWithError(args, PyTuple_GET_ITEM(id, 0));
        if (v == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(id, 0));
            return -1;
        }
        if (PyLong_CheckExact(v)) {
            int overflow = 0;
            long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (x == -1 && PyErr_Occurred()) return -1;
            if (overflow || x < 0) {
                te->n = start;
                return 0;
            }
            char lv[10];
            int nl = varint_to(lv, (uint64_t)x);
            if (add_ann(te, PyTuple_GET_ITEM(id, 1), lv, nl) < 0) return -1;
        } else if (PyFloat_CheckExact(v)) {
            double x = PyFloat_AS_DOUBLE(v);
            char raw[8];
            memcpy(raw, &x, 8);
            if (add_ann(te, PyTuple_GET_ITEM(id, 2), raw, 8) < 0) return -1;
        } else if (PyUnicode_CheckExact(v)) {
            if (add_ann_text(te, PyTuple_GET_ITEM(id, 3), v) < 0) return -1;
        } else {
            te->n = start;
            return 0;
        }
        if (buf_bytes(te, PyTuple_GET_ITEM(runs, j + 1)) < 0) return -1;
    }
    return 1;
}

/* the plan's cache key as JSON: the args' non-id values, in key order */
static PyObject *json_key(PyObject *args, PyObject *order, PyObject *pos) {
    Py_ssize_t nk = PyTuple_GET_SIZE(order), np = PyList_GET_SIZE(pos);
    PyObject *fixed = PyTuple_New(nk - np);
    if (fixed == NULL) return NULL;
    Py_ssize_t f = 0, p = 0;
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (p < np && PyLong_AsSsize_t(PyList_GET_ITEM(pos, p)) == i) {
            p++;
            continue;
        }
        if (f >= nk - np) break;
        PyObject *v = PyDict_GetItemWithError(args, PyTuple_GET_ITEM(order, i));
        if (v == NULL) {
            Py_DECREF(fixed);
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(order, i));
            return NULL;
        }
        Py_INCREF(v);
        PyTuple_SET_ITEM(fixed, f++, v);
    }
    if (f != nk - np) {
        Py_DECREF(fixed);
        PyErr_SetString(PyExc_TypeError, "commviz: malformed args plan positions");
        return NULL;
    }
    PyObject *key = PyObject_CallOneArg(k_dumps, fixed);
    Py_DECREF(fixed);
    return key;
}

/* One value of a cache key: a type byte and the value's bytes (a str's UTF-8 after its
 * length, an int's or a float's 8 bytes; a bool or None the byte alone). 1 when written, 0
 * for a value of another kind (a list, an int past 64 bits, a str with a lone surrogate),
 * -1 on an error. */
static int key_value(Buf *kb, PyObject *v) {
    char b[11];
    if (PyUnicode_CheckExact(v)) {
        Py_ssize_t n;
        const char *u = PyUnicode_AsUTF8AndSize(v, &n);
        if (u == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return -1;
            PyErr_Clear();
            return 0;
        }
        b[0] = 's';
        int nl = varint_to(b + 1, (uint64_t)n);
        return buf_add(kb, b, 1 + nl) < 0 || buf_add(kb, u, n) < 0 ? -1 : 1;
    }
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) return -1;
        if (overflow) return 0;
        b[0] = 'i';
        memcpy(b + 1, &x, 8);
        return buf_add(kb, b, 9) < 0 ? -1 : 1;
    }
    if (PyFloat_CheckExact(v)) {
        double x = PyFloat_AS_DOUBLE(v);
        b[0] = 'f';
        memcpy(b + 1, &x, 8);
        return buf_add(kb, b, 9) < 0 ? -1 : 1;
    }
    if (v == Py_True || v == Py_False || v == Py_None) {
        b[0] = v == Py_True ? 'T' : v == Py_False ? 'F' : 'N';
        return buf_add(kb, b, 1) < 0 ? -1 : 1;
    }
    return 0;
}

/* the plan's cache key: the args' non-id values, in key order, each as ``key_value`` writes
 * it after a first byte 0x01 (one buffer and one bytes object an event, where their tuple's
 * JSON cost a call and a serialization), or, where a value is of another kind, their JSON
 * (which starts with '['): equal keys, equal values of equal types, as the JSON's were. */
static PyObject *plan_key(PyObject *args, PyObject *order, PyObject *pos, Buf *kb) {
    Py_ssize_t nk = PyTuple_GET_SIZE(order), np = PyList_GET_SIZE(pos), p = 0, f = 0;
    kb->n = 0;
    if (buf_add(kb, "\x01", 1) < 0) return NULL;
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (p < np && PyLong_AsSsize_t(PyList_GET_ITEM(pos, p)) == i) {
            p++;
            continue;
        }
        PyObject *v = PyDict_GetItemWithError(args, PyTuple_GET_ITEM(order, i));
        if (v == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(order, i));
            return NULL;
        }
        int rc = key_value(kb, v);
        if (rc < 0) return NULL;
        if (rc == 0) return json_key(args, order, pos);
        f++;
    }
    if (f != nk - np) {
        PyErr_SetString(PyExc_TypeError, "commviz: malformed args plan positions");
        return NULL;
    }
    return PyBytes_FromStringAndSize(kb->p, kb->n);
}

typedef struct {
    PyObject *seq, *names, *cats, *keys, *plans, *head, *end_hdr, *end_tail, *pending;
} Seq;

static void seq_clear(Seq *s) {
    Py_XDECREF(s->names);
    Py_XDECREF(s->cats);
    Py_XDECREF(s->keys);
    Py_XDECREF(s->plans);
    Py_XDECREF(s->head);
    Py_XDECREF(s->end_hdr);
    Py_XDECREF(s->end_tail);
    Py_XDECREF(s->pending);
}

static int seq_load(Seq *s, PyObject *seq) {
    memset(s, 0, sizeof(*s));
    s->seq = seq;
    if (!(s->names = PyObject_GetAttr(seq, s_names)) || !(s->cats = PyObject_GetAttr(seq, s_cats))
        || !(s->keys = PyObject_GetAttr(seq, s_keys)) || !(s->plans = PyObject_GetAttr(seq, s_plans))
        || !(s->head = PyObject_GetAttr(seq, s_head))
        || !(s->end_hdr = PyObject_GetAttr(seq, s_end_hdr))
        || !(s->end_tail = PyObject_GetAttr(seq, s_end_tail))
        || !(s->pending = PyObject_GetAttr(seq, s_pending)))
        return -1;
    if (!PyDict_CheckExact(s->names) || !PyDict_CheckExact(s->cats) || !PyDict_CheckExact(s->keys)
        || !PyDict_CheckExact(s->plans) || !PyBytes_Check(s->head) || !PyList_Check(s->end_hdr)
        || !PyBytes_Check(s->end_tail) || !PyByteArray_Check(s->pending)) {
        PyErr_SetString(PyExc_TypeError, "commviz: not a pftrace Sequence");
        return -1;
    }
    return 0;
}

/* name or category field bytes: the table's, else the Sequence method's (interning it) */
static PyObject *interned(PyObject *table, PyObject *seq, PyObject *method, PyObject *value) {
    PyObject *b = dget(table, value);
    if (b != NULL || PyErr_Occurred()) return b;
    PyObject *text = PyObject_Str(value);
    if (text == NULL) return NULL;
    b = call_method1(seq, method, text);
    Py_DECREF(text);
    return b;
}

/* The plans of the key orders seen last in this call, found again by comparing key objects
 * (a decoder hands every event the same key strings): no tuple to build and hash per event.
 * Emptied whenever ``_plan`` runs, since it may put a new plan in a key order's place. */
#define MEMO 8
typedef struct {
    PyObject *order, *plan, *pos, *ids, *cache;
} Memo;

static void memo_clear(Memo *memo) {
    for (int i = 0; i < MEMO; i++) {
        Py_CLEAR(memo[i].order);
        Py_CLEAR(memo[i].plan);
        Py_CLEAR(memo[i].pos);
        Py_CLEAR(memo[i].ids);
        Py_CLEAR(memo[i].cache);
    }
}

static Memo *memo_find(Memo *memo, PyObject *args) {
    Py_ssize_t n = PyDict_GET_SIZE(args);
    for (int i = 0; i < MEMO; i++) {
        PyObject *order = memo[i].order;
        if (order == NULL || PyTuple_GET_SIZE(order) != n) continue;
        Py_ssize_t pos = 0, j = 0;
        PyObject *k, *v;
        while (PyDict_Next(args, &pos, &k, &v) && PyTuple_GET_ITEM(order, j) == k) j++;
        if (j == n) return &memo[i];
    }
    return NULL;
}

static Memo *memo_add(Memo *memo, int *next, PyObject *order, PyObject *plan) {
    Memo *m = &memo[*next];
    *next = (*next + 1) % MEMO;
    Py_CLEAR(m->order);
    Py_CLEAR(m->plan);
    Py_CLEAR(m->pos);
    Py_CLEAR(m->ids);
    Py_CLEAR(m->cache);
    if (!(m->pos = PyObject_GetAttr(plan, s_pos)) || !(m->ids = PyObject_GetAttr(plan, s_ids))
        || !(m->cache = PyObject_GetAttr(plan, s_cache)))
        goto bad;
    if (!PyList_Check(m->pos) || !PyList_Check(m->ids) || !PyDict_Check(m->cache)) {
        PyErr_SetString(PyExc_TypeError, "commviz: malformed args plan");
        goto bad;
    }
    Py_INCREF(order);
    Py_INCREF(plan);
    m->order = order;
    m->plan = plan;
    return m;
bad:
    Py_CLEAR(m->pos);
    Py_CLEAR(m->ids);
    Py_CLEAR(m->cache);
    return NULL;
}

static PyObject *key_order(PyObject *args) {
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v, *order = PyTuple_New(PyDict_GET_SIZE(args));
    if (order == NULL) return NULL;
    while (PyDict_Next(args, &pos, &k, &v)) {
        Py_INCREF(k);
        PyTuple_SET_ITEM(order, i++, k);
    }
    return order;
}

/* the args of one event: cached runs when its plan has them, else arg by arg (stored in the
 * plan for the next time, as Python's loop does) */
static int encode_event_args(Seq *s, Memo *memo, int *memo_next, PyObject *args, Buf *te,
                             Buf *kb) {
    int rc = -1;
    PyObject *order = NULL, *ck = NULL, *parts = NULL, *found = NULL;
    Memo *m = memo_find(memo, args);
    if (m == NULL) {
        order = key_order(args);
        if (order == NULL) return -1;
        found = dget(s->plans, order);
        if (found == NULL) {
            if (PyErr_Occurred()) goto done;
            found = PyObject_CallFunctionObjArgs(k_plan_fn, s->seq, order, NULL);
            if (found == NULL) goto done;
            memo_clear(memo);
        }
        if (found != Py_None && (m = memo_add(memo, memo_next, order, found)) == NULL) goto done;
    }
    if (m != NULL) {
        ck = plan_key(args, m->order, m->pos, kb);
        if (ck == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto done;
            PyErr_Clear();                  /* an integer past 64 bits, a non-str dict key */
        } else {
            PyObject *runs = PyDict_GetItemWithError(m->cache, ck);
            if (runs == NULL && PyErr_Occurred()) goto done;
            if (runs != NULL) {
                Py_INCREF(runs);
                int got = encode_cached(args, m->ids, runs, te);
                Py_DECREF(runs);
                if (got < 0) goto done;
                if (got == 1) {
                    rc = 0;
                    goto done;
                }
            }
            parts = PyList_New(0);
            if (parts == NULL) goto done;
        }
    }
    if (encode_args(s->seq, s->keys, args, te, parts) < 0) goto done;
    if (ck != NULL && PyDict_GET_SIZE(m->cache) < k_plan_cache_max) {
        PyObject *plan = m->plan, *cache = m->cache, *morder = m->order;
        Py_INCREF(plan);
        Py_INCREF(cache);
        Py_INCREF(morder);
        PyObject *r = PyObject_CallMethodObjArgs(plan, s_store, ck, args, parts, NULL);
        Py_ssize_t next = -1;
        if (r != NULL) {
            Py_DECREF(r);
            PyObject *nc = PyObject_GetAttr(plan, s_next_check);
            if (nc != NULL) {
                next = PyLong_AsSsize_t(nc);
                Py_DECREF(nc);
            }
        }
        int err = PyErr_Occurred() != NULL;
        if (!err && PyDict_GET_SIZE(cache) >= next) {   /* which keys are ids, looked again */
            r = PyObject_CallFunctionObjArgs(k_plan_fn, s->seq, morder, NULL);
            memo_clear(memo);
            if (r == NULL)
                err = 1;
            else
                Py_DECREF(r);
        }
        Py_DECREF(plan);
        Py_DECREF(cache);
        Py_DECREF(morder);
        if (err) goto done;
    }
    rc = 0;
done:
    Py_XDECREF(order);
    Py_XDECREF(found);
    Py_XDECREF(ck);
    Py_XDECREF(parts);
    return rc;
}

static int read_item(PyObject *item, int64_t *start, int64_t *neg_end, PyObject **index) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_SetString(PyExc_TypeError, "commviz: an item is (start_ns, -end_ns, index)");
        return -1;
    }
    int o1 = 0, o2 = 0;
    *start = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(item, 0), &o1);
    if (*start == -1 && PyErr_Occurred()) return -1;
    *neg_end = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(item, 1), &o2);
    if (*neg_end == -1 && PyErr_Occurred()) return -1;
    if (o1 || o2) {
        PyErr_SetString(PyExc_OverflowError, "commviz: a time past int64 nanoseconds");
        return -1;
    }
    *index = PyTuple_GET_ITEM(item, 2);
    return 0;
}

/* The event of ``items[k]`` (start, -end, index) when the index is one of ``events``', else
 * NULL. */
static PyObject *event_of(PyObject *items, PyObject *events, Py_ssize_t k) {
    if (k >= PyList_GET_SIZE(items)) return NULL;
    PyObject *item = PyList_GET_ITEM(items, k);
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 3) return NULL;
    return item_at(events, PyTuple_GET_ITEM(item, 2));
}

/* ``prefetch_ahead`` for the slices of a track (their events in time order, not in list
 * order), and the args of the events a few slices ahead, whose keys and values the loop
 * reads too. */
static void prefetch_slices(PyObject *items, PyObject *events, Py_ssize_t k) {
    PyObject *ev = event_of(items, events, k + PREFETCH_FAR);
    if (ev != NULL) PREFETCH(ev);
    prefetch_keys(event_of(items, events, k + PREFETCH_NEAR));
    prefetch_values(event_of(items, events, k + PREFETCH_VALUES));
    ev = event_of(items, events, k + PREFETCH_ARGS);
    if (ev != NULL && PyDict_CheckExact(ev)) {
        PyObject *args = PyDict_GetItemWithError(ev, s_args);
        if (args == NULL) PyErr_Clear();
        prefetch_keys(args);
    }
}

static PyObject *emit_slices(PyObject *self, PyObject *argt, PyObject *kw) {
    static char *kwlist[] = {"seq", "out", "items", "events", "extra", "flows", NULL};
    PyObject *seq, *out, *items, *events, *extra = Py_None, *flows = Py_None;
    if (!ready) {
        PyErr_SetString(PyExc_RuntimeError, "commviz: _emit.setup was not called");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(argt, kw, "OOOO|OO", kwlist, &seq, &out, &items, &events,
                                     &extra, &flows))
        return NULL;
    if (!PyByteArray_Check(out) || !PyList_Check(events)) {
        PyErr_SetString(PyExc_TypeError, "commviz: out is a bytearray, events a list");
        return NULL;
    }
    if ((extra != Py_None && !PyDict_Check(extra)) || (flows != Py_None && !PyDict_Check(flows))) {
        PyErr_SetString(PyExc_TypeError, "commviz: extra and flows are dicts");
        return NULL;
    }
    Seq s;
    Memo memo[MEMO] = {{0}};
    int memo_next = 0;
    Buf te = {0}, pk = {0}, kb = {0};
    int64_t *stack = NULL;
    Py_ssize_t depth = 0, cap = 0;
    long long count = 0;
    PyObject *it = NULL, *item = NULL, *result = NULL, *merged = NULL;
    if (seq_load(&s, seq) < 0) goto done;
    PyObject *last_obj = PyObject_GetAttr(seq, s_last_ts);
    if (last_obj == NULL) goto done;
    int64_t last = PyLong_AsLongLong(last_obj);
    Py_DECREF(last_obj);
    if (last == -1 && PyErr_Occurred()) goto done;
    it = PyObject_GetIter(items);
    if (it == NULL) goto done;
    Py_ssize_t k = 0;
    int ahead = PyList_CheckExact(items);
    while ((item = PyIter_Next(it)) != NULL) {
        if (ahead) prefetch_slices(items, events, k++);
        int64_t start, neg_end;
        PyObject *index;
        if (read_item(item, &start, &neg_end, &index) < 0) goto done;
        if (pop_ends(out, &pk, &stack, &depth, start, 0, &last, s.end_hdr, s.end_tail) < 0)
            goto done;
        Py_ssize_t at = PyNumber_AsSsize_t(index, PyExc_IndexError);
        if (at == -1 && PyErr_Occurred()) goto done;
        PyObject *ev = PyList_GetItem(events, at);
        if (ev == NULL) goto done;
        if (!PyDict_Check(ev)) {
            PyErr_SetString(PyExc_TypeError, "commviz: an event is not a dict");
            goto done;
        }
        te.n = 0;
        if (buf_bytes(&te, start == -neg_end ? k_te_instant : k_te_begin) < 0) goto done;
        PyObject *name = PyDict_GetItemWithError(ev, s_name);
        if (name == NULL && PyErr_Occurred()) goto done;
        PyObject *nb = interned(s.names, seq, s_name, name ? name : s_empty);
        if (nb == NULL) goto done;
        int ok = PyBytes_Check(nb) && buf_bytes(&te, nb) == 0;
        Py_DECREF(nb);
        if (!ok) goto done;
        PyObject *cat = PyDict_GetItemWithError(ev, s_cat);
        if (cat == NULL && PyErr_Occurred()) goto done;
        if (cat != NULL) {
            int truth = PyObject_IsTrue(cat);
            if (truth < 0) goto done;
            if (truth) {
                PyObject *cb = interned(s.cats, seq, s_cat, cat);
                if (cb == NULL) goto done;
                ok = PyBytes_Check(cb) && buf_bytes(&te, cb) == 0;
                Py_DECREF(cb);
                if (!ok) goto done;
            }
        }
        PyObject *args = PyDict_GetItemWithError(ev, s_args);
        if (args == NULL && PyErr_Occurred()) goto done;
        PyObject *more = NULL;
        if (extra != Py_None) {
            more = PyDict_GetItemWithError(extra, index);
            if (more == NULL && PyErr_Occurred()) goto done;
        }
        Py_CLEAR(merged);
        int more_true = more ? PyObject_IsTrue(more) : 0;
        if (more_true < 0) goto done;
        int args_true = args ? PyObject_IsTrue(args) : 0;
        if (args_true < 0) goto done;
        if (more_true) {
            if (args_true) {
                merged = PyDict_New();
                if (merged == NULL || PyDict_Update(merged, args) < 0
                    || PyDict_Update(merged, more) < 0)
                    goto done;
                args = merged;
            } else {
                args = more;
            }
            args_true = 1;
        }
        if (args_true) {
            if (!PyDict_Check(args)) {
                PyErr_SetString(PyExc_TypeError, "commviz: an event's args are not an object");
                goto done;
            }
            if (encode_event_args(&s, memo, &memo_next, args, &te, &kb) < 0) goto done;
        }
        if (flows != Py_None) {
            PyObject *f = PyDict_GetItemWithError(flows, index);
            if (f == NULL && PyErr_Occurred()) goto done;
            if (f != NULL && PyBytes_Check(f) && PyBytes_GET_SIZE(f) > 0 && buf_bytes(&te, f) < 0)
                goto done;
        }
        /* the packet: ts delta, sequence head, pending interned data, the TrackEvent */
        uint64_t d = (uint64_t)(start - last);
        last = start;
        Py_ssize_t npend = PyByteArray_GET_SIZE(s.pending);
        pk.n = 0;
        char lv[10];
        if (buf_bytes(&pk, k_ts) < 0 || buf_varint(&pk, d) < 0 || buf_bytes(&pk, s.head) < 0)
            goto done;
        if (npend > 0) {
            if (buf_bytes(&pk, k_interned) < 0 || buf_varint(&pk, (uint64_t)npend) < 0
                || buf_add(&pk, PyByteArray_AS_STRING(s.pending), npend) < 0)
                goto done;
            if (PyByteArray_Resize(s.pending, 0) < 0) goto done;
        }
        if (buf_bytes(&pk, k_track_event) < 0 || buf_varint(&pk, (uint64_t)te.n) < 0
            || buf_add(&pk, te.p, te.n) < 0)
            goto done;
        int nl = varint_to(lv, (uint64_t)pk.n);
        char head[11];
        head[0] = 0x0a;
        memcpy(head + 1, lv, nl);
        if (append_out(out, head, 1 + nl) < 0 || append_out(out, pk.p, pk.n) < 0) goto done;
        if (start != -neg_end) {
            if (depth == cap) {
                Py_ssize_t ncap = cap ? cap * 2 : 16;
                int64_t *ns = PyMem_Realloc(stack, ncap * sizeof(int64_t));
                if (ns == NULL) {
                    PyErr_NoMemory();
                    goto done;
                }
                stack = ns;
                cap = ncap;
            }
            stack[depth++] = -neg_end;
        }
        count++;
        Py_CLEAR(item);
    }
    if (PyErr_Occurred()) goto done;
    if (pop_ends(out, &pk, &stack, &depth, 0, 1, &last, s.end_hdr, s.end_tail) < 0) goto done;
    PyObject *lt = PyLong_FromLongLong(last);
    if (lt == NULL) goto done;
    int set = PyObject_SetAttr(seq, s_last_ts, lt);
    Py_DECREF(lt);
    if (set < 0) goto done;
    result = PyLong_FromLongLong(count);
done:
    Py_XDECREF(item);
    Py_XDECREF(it);
    Py_XDECREF(merged);
    memo_clear(memo);
    seq_clear(&s);
    PyMem_Free(te.p);
    PyMem_Free(pk.p);
    PyMem_Free(kb.p);
    PyMem_Free(stack);
    return result;
}

static PyObject *setup(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"ann", "te_begin", "te_instant", "ts", "interned", "track_event",
                            "a_int", "a_string", "plan", "dumps", "plan_cache_max", NULL};
    PyObject *o[10];
    Py_ssize_t maxc;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "SSSSSSSSOOn", names, &o[0], &o[1], &o[2], &o[3],
                                     &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &maxc))
        return NULL;
    PyObject **slots[10] = {&k_ann, &k_te_begin, &k_te_instant, &k_ts, &k_interned,
                            &k_track_event, &k_a_int, &k_a_string, &k_plan_fn, &k_dumps};
    for (int i = 0; i < 10; i++) {
        PyObject *old = *slots[i];
        Py_INCREF(o[i]);
        *slots[i] = o[i];
        Py_XDECREF(old);
    }
    k_plan_cache_max = maxc;
    ready = 1;
    Py_RETURN_NONE;
}

/* ---- split: items over the fewest backing tracks that nest --------------------------------- */

typedef struct {
    int64_t *ends;
    Py_ssize_t n, cap;
} Stack;

/* An item's (start, end) where both are ints of int64: 1, else 0 (Python's split takes it). */
static int item_span(PyObject *item, int64_t *start, int64_t *end) {
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) < 2) return 0;
    PyObject *a = PyTuple_GET_ITEM(item, 0), *b = PyTuple_GET_ITEM(item, 1);
    if (!PyLong_CheckExact(a) || !PyLong_CheckExact(b)) return 0;
    int oa = 0, ob = 0;
    long long s = PyLong_AsLongLongAndOverflow(a, &oa), e = PyLong_AsLongLongAndOverflow(b, &ob);
    if (oa || ob || e == LLONG_MIN) return 0;
    *start = s;
    *end = -e;
    return 1;
}

/* split(items) -> list of lists, or None where an item is not (int, int, ...) of int64 */
static PyObject *split(PyObject *self, PyObject *items) {
    if (!PyList_CheckExact(items)) Py_RETURN_NONE;
    Py_ssize_t n_items = PyList_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n_items; i++) {
        int64_t s, e;
        if (!item_span(PyList_GET_ITEM(items, i), &s, &e)) Py_RETURN_NONE;
    }
    PyObject *backs = PyList_New(0);
    Stack *stacks = NULL;
    Py_ssize_t n_stacks = 0, cap_stacks = 0;
    if (backs == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n_items; i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        int64_t start, end;
        item_span(item, &start, &end);
        Py_ssize_t n = 0;
        for (; n < n_stacks; n++) {
            Stack *st = &stacks[n];
            while (st->n && st->ends[st->n - 1] <= start) st->n--;
            if (!st->n || st->ends[st->n - 1] >= end) break;
        }
        if (n == n_stacks) {                      /* crossing every open slice: a new track */
            if (n_stacks == cap_stacks) {
                Py_ssize_t cap = cap_stacks ? 2 * cap_stacks : 4;
                Stack *grown = PyMem_Realloc(stacks, cap * sizeof(Stack));
                if (grown == NULL) goto nomem;
                stacks = grown;
                cap_stacks = cap;
            }
            stacks[n_stacks++] = (Stack){NULL, 0, 0};
            PyObject *back = PyList_New(0);
            if (back == NULL) goto fail;
            int rc = PyList_Append(backs, back);
            Py_DECREF(back);
            if (rc < 0) goto fail;
        }
        Stack *st = &stacks[n];
        if (st->n == st->cap) {
            Py_ssize_t cap = st->cap ? 2 * st->cap : 8;
            int64_t *grown = PyMem_Realloc(st->ends, cap * sizeof(int64_t));
            if (grown == NULL) goto nomem;
            st->ends = grown;
            st->cap = cap;
        }
        st->ends[st->n++] = end;
        if (PyList_Append(PyList_GET_ITEM(backs, n), item) < 0) goto fail;
    }
    for (Py_ssize_t k = 0; k < n_stacks; k++) PyMem_Free(stacks[k].ends);
    PyMem_Free(stacks);
    return backs;
nomem:
    PyErr_NoMemory();
fail:
    for (Py_ssize_t k = 0; k < n_stacks; k++) PyMem_Free(stacks[k].ends);
    PyMem_Free(stacks);
    Py_DECREF(backs);
    return NULL;
}

static PyMethodDef methods[] = {
    {"emit_slices", (PyCFunction)(void (*)(void))emit_slices, METH_VARARGS | METH_KEYWORDS,
     "emit_slices(seq, out, items, events, extra=None, flows=None) -> int: as "
     "commviz.write.pftrace.emit_slices"},
    {"split", split, METH_O,
     "split(items) -> backing tracks as commviz.write.pftrace.python_split, or None where an "
     "item is not (int, int, ...) of int64"},
    {"setup", (PyCFunction)(void (*)(void))setup, METH_VARARGS | METH_KEYWORDS,
     "Hand over the wire constants and the Python helpers (pftrace does, once)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_emit", NULL, -1, methods};

PyMODINIT_FUNC PyInit__emit(void) {
    struct {
        PyObject **slot;
        const char *text;
    } strs[] = {{&s_names, "names"},       {&s_cats, "cats"},         {&s_keys, "keys"},
                {&s_plans, "plans"},       {&s_head, "head"},         {&s_end_hdr, "end_hdr"},
                {&s_end_tail, "end_tail"}, {&s_pending, "pending"},   {&s_last_ts, "last_ts"},
                {&s_name, "name"},         {&s_cat, "cat"},           {&s_key, "key"},
                {&s_ann_str, "ann_str"},   {&s_ann_int, "ann_int"},   {&s_ann_float, "ann_float"},
                {&s_ann_value, "ann_value"}, {&s_args, "args"},       {&s_pos, "pos"},
                {&s_ids, "ids"},           {&s_cache, "cache"},       {&s_next_check, "next_check"},
                {&s_store, "store"},       {&s_empty, ""}};
    for (size_t i = 0; i < sizeof(strs) / sizeof(strs[0]); i++) {
        *strs[i].slot = PyUnicode_InternFromString(strs[i].text);
        if (*strs[i].slot == NULL) return NULL;
    }
    k_one = PyLong_FromLong(1);
    if (k_one == NULL) return NULL;
    return PyModule_Create(&module);
}
