/* commviz.trace._scan: the passes over every event of a rank's traces, in C.
 *
 * ``index_events`` is ``commviz.trace.joinable.python_index_events``, ``time_bounds``
 * ``commviz.trace.load.python_time_bounds``, ``gpu_index`` ``commviz.trace.gpu.
 * python_gpu_index``, ``slices`` the common part of ``commviz.merge.piece._Layout``'s pass
 * (complete events and flow points) and ``bind_flows`` ``commviz.merge.flows.Binder.
 * python_bind``, each step for step on the same dicts: the same keys read, the same objects
 * made, in the same order, so the Python versions stay the reference and the fallback where
 * nothing was compiled (tests/test_scan.py compares them on every fixture trace). ``slices``
 * and ``gpu_index`` take only what they can do exactly (a time that is a finite float or an
 * int, a duration that is one or absent, args that are a dict); at anything else they hand
 * that one event to Python, and ``bind_flows`` binds only the usual launch flow (one slice with
 * its id on each point's track), every other flow by the Python binder. What runs here is the
 * per-event dict reads and arithmetic, without the interpreter's per-operation overhead.
 * Categories, prefixes and limits come from Python, so each has one place. ``shapes_into`` works
 * on a trace's text before it is decoded (``commviz.trace.load.shapes_text``); it has no Python
 * twin: without it the shape lists are decoded as lists, and the writer writes the same text.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../_prefetch.h"

static PyObject *s_pid, *s_tid, *s_ph, *s_cat, *s_name, *s_ts, *s_dur, *s_args, *s_corr,
    *s_id, *s_X, *s_M, *s_node, *s_stream, *s_cbid, *s_runtime, *s_empty, *s_s, *k_zero,
    *k_zero_f;

/* A dict read as ``d.get(key)``: a borrowed value or Py_None; NULL only on an error. */
static PyObject *get(PyObject *d, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL && !PyErr_Occurred()) return Py_None;
    return v;
}

/* A string of ASCII digits (``s.isascii() and s.isdigit()``). */
static int digit_string(PyObject *v) {
    if (!PyUnicode_CheckExact(v) || !PyUnicode_IS_ASCII(v)) return 0;
    Py_ssize_t n = PyUnicode_GET_LENGTH(v);
    const Py_UCS1 *p = PyUnicode_1BYTE_DATA(v);
    if (n == 0) return 0;
    for (Py_ssize_t k = 0; k < n; k++)
        if (p[k] < '0' || p[k] > '9') return 0;
    return 1;
}

/* ``e[key] = int(e[key])`` where the value is a digit string: -1 on an error. */
static int id_as_number(PyObject *e, PyObject *key, PyObject *value) {
    if (!digit_string(value)) return 0;
    PyObject *num = PyLong_FromUnicodeObject(value, 10);
    if (num == NULL) return -1;
    int rc = PyDict_SetItem(e, key, num);
    Py_DECREF(num);
    return rc;
}

/* One event of ``index_events``: its ids read as numbers, then whether it is joinable (1, 0;
 * -1 on an error). */
static int index_one(PyObject *e, PyObject *join_cats, PyObject *named) {
    int add = 0;
    PyObject *pid = get(e, s_pid), *tid;
    if (pid == NULL) return -1;
    Py_INCREF(pid);
    tid = get(e, s_tid);
    if (tid == NULL) {
        Py_DECREF(pid);
        return -1;
    }
    Py_INCREF(tid);
    int rc = id_as_number(e, s_pid, pid);
    if (rc == 0) rc = id_as_number(e, s_tid, tid);
    Py_DECREF(pid);
    Py_DECREF(tid);
    if (rc < 0) return -1;
    PyObject *ph = get(e, s_ph);
    if (ph == NULL) return -1;
    int is_x = PyObject_RichCompareBool(ph, s_X, Py_EQ);
    if (is_x <= 0) return is_x;
    PyObject *cat = get(e, s_cat);
    if (cat == NULL) return -1;
    int in = PySequence_Contains(join_cats, cat);
    if (in != 0) return in;
    PyObject *name = get(e, s_name);
    if (name == NULL) return -1;
    if (PyUnicode_CheckExact(name)) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(named) && !add; k++) {
            Py_ssize_t m = PyUnicode_Tailmatch(name, PyTuple_GET_ITEM(named, k), 0,
                                               PY_SSIZE_T_MAX, -1);
            if (m < 0) return -1;
            add = (int)m;
        }
    }
    return add;
}

/* ``index_events``' loop, and where ``bounds`` is given ``time_bounds``' in the same pass
 * (``bounds_one``): the joinable indices, or NULL on an error. */
static int bounds_one(PyObject *e, PyObject **b, double *v);

static PyObject *index_loop(PyObject *events, PyObject *join_cats, PyObject *named,
                            PyObject **bounds, double *values, int *exact) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        prefetch_ahead(events, i);
        PyObject *e = PyList_GET_ITEM(events, i);
        if (!PyDict_CheckExact(e)) continue;
        Py_INCREF(e);
        int add = index_one(e, join_cats, named);
        if (add >= 0 && bounds != NULL && *exact) {
            int rc = bounds_one(e, bounds, values);
            if (rc < 0) add = -1;
            else if (rc == 0) *exact = 0;
        }
        Py_DECREF(e);
        if (add < 0) {
            Py_DECREF(out);
            return NULL;
        }
        if (add) {
            PyObject *num = PyLong_FromSsize_t(i);
            if (num == NULL || PyList_Append(out, num) < 0) {
                Py_XDECREF(num);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(num);
        }
    }
    return out;
}

static PyObject *index_events(PyObject *self, PyObject *args) {
    PyObject *events, *join_cats, *named;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &events, &PyFrozenSet_Type, &join_cats,
                          &PyTuple_Type, &named))
        return NULL;
    return index_loop(events, join_cats, named, NULL, NULL, NULL);
}

/* An int (not a bool) that fits int64: 1 with *out set, else 0. */
static int int64_of(PyObject *v, long long *out) {
    if (!PyLong_CheckExact(v)) return 0;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* A number's value where a double holds it exactly (a finite float, an int within 2**53): 1,
 * else 0 (a bool, a string, NaN, a big int: the Python pass decides about those). */
static int exact_double(PyObject *v, double *out) {
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        return isfinite(*out);
    }
    long long u;
    if (int64_of(v, &u) && u <= (1LL << 53) && u >= -(1LL << 53)) {
        *out = (double)u;
        return 1;
    }
    return 0;
}

/* One event of ``time_bounds`` into ``b`` (lo, hi, longest, shortest: borrowed, NULL for
 * none yet) and their values ``v``: 1, or 0 where a value is not a number a double holds
 * exactly, -1 on an error. */
static int bounds_one(PyObject *e, PyObject **b, double *v) {
    PyObject *ts = PyDict_GetItemWithError(e, s_ts);
    if (ts == NULL) return PyErr_Occurred() ? -1 : 1;
    PyObject *ph = get(e, s_ph);
    if (ph == NULL) return -1;
    int is_m = PyObject_RichCompareBool(ph, s_M, Py_EQ);
    if (is_m != 0) return is_m < 0 ? -1 : 1;
    PyObject *dur = PyDict_GetItemWithError(e, s_dur);
    if (dur == NULL) {
        if (PyErr_Occurred()) return -1;
        dur = k_zero;
    }
    double x;
    if (!exact_double(ts, &x)) return 0;
    if (b[0] == NULL || x < v[0]) { b[0] = ts; v[0] = x; }
    if (b[1] == NULL || x > v[1]) { b[1] = ts; v[1] = x; }
    if (!exact_double(dur, &x)) return 0;
    if (b[2] == NULL || x > v[2]) { b[2] = dur; v[2] = x; }
    if (b[3] == NULL || x < v[3]) { b[3] = dur; v[3] = x; }
    return 1;
}

/* (lo, hi, longest, shortest) as a tuple (0.0 for none), or None where not ``exact`` */
static PyObject *bounds_tuple(PyObject **b, int exact) {
    if (!exact) Py_RETURN_NONE;
    if (b[0] == NULL) b[0] = b[1] = b[2] = b[3] = k_zero_f;
    return PyTuple_Pack(4, b[0], b[1], b[2], b[3]);
}

/* time_bounds(events) -> (lo, hi, longest, shortest) | None: the least and greatest ``ts``
 * and ``dur`` (0 where absent) of the timed events (dicts with a ``ts``, phase not M), the
 * objects themselves, the first of equals as min() and max() give them (0.0 for none); None
 * where a value is not a number a double holds exactly (load.python_time_bounds then
 * decides). */
static PyObject *time_bounds(PyObject *self, PyObject *events) {
    if (!PyList_CheckExact(events)) Py_RETURN_NONE;
    PyObject *b[4] = {NULL, NULL, NULL, NULL};
    double v[4] = {0, 0, 0, 0};
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        prefetch_ahead(events, i);
        PyObject *e = PyList_GET_ITEM(events, i);
        if (!PyDict_CheckExact(e)) continue;
        int rc = bounds_one(e, b, v);
        if (rc < 0) return NULL;
        if (rc == 0) Py_RETURN_NONE;
    }
    return bounds_tuple(b, 1);
}

/* scan_loaded(events, join_cats, named_prefixes) -> (joinable, bounds): ``index_events`` and
 * ``time_bounds`` in one pass, for a trace just decoded (each event read once while it is
 * still in the cache). The bounds are read before ``index_events`` changes any id. */
static PyObject *scan_loaded(PyObject *self, PyObject *args) {
    PyObject *events, *join_cats, *named;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &events, &PyFrozenSet_Type, &join_cats,
                          &PyTuple_Type, &named))
        return NULL;
    PyObject *b[4] = {NULL, NULL, NULL, NULL};
    double v[4] = {0, 0, 0, 0};
    int exact = 1;
    PyObject *joinable = index_loop(events, join_cats, named, b, v, &exact);
    if (joinable == NULL) return NULL;
    PyObject *bounds = bounds_tuple(b, exact);
    if (bounds == NULL) {
        Py_DECREF(joinable);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, joinable, bounds);
    Py_DECREF(joinable);
    Py_DECREF(bounds);
    return out;
}

/* ``round(v * 1000)`` for a float or an int (not a bool): 1 with *ns set; 0 where it is
 * something else, not finite or past int64, which the Python pass then takes. */
static int to_ns(PyObject *v, int64_t *ns) {
    if (PyFloat_CheckExact(v)) {
        double x = PyFloat_AS_DOUBLE(v) * 1000.0;
        if (!isfinite(x)) return 0;
        double r = nearbyint(x);             /* halves to even, as round() */
        if (!(r >= -9.2e18 && r <= 9.2e18)) return 0;
        *ns = (int64_t)r;
        return 1;
    }
    long long u;
    return int64_of(v, &u) && !__builtin_mul_overflow((int64_t)u, (int64_t)1000, ns);
}

/* A NamedTuple ``type`` made from its fields as tuple's own constructor makes a subtype's
 * (``tuple.__new__(type, fields)``): without running the class's Python ``__new__``. */
static PyObject *named_tuple(PyObject *type, PyObject *const *fields, Py_ssize_t n) {
    PyTypeObject *t = (PyTypeObject *)type;
    if (!PyType_Check(type) || !PyType_IsSubtype(t, &PyTuple_Type) || t->tp_itemsize == 0) {
        PyErr_SetString(PyExc_TypeError, "commviz: a NamedTuple type was expected");
        return NULL;
    }
    PyObject *out = t->tp_alloc(t, n);
    if (out == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_INCREF(fields[k]);
        PyTuple_SET_ITEM(out, k, fields[k]);
    }
    return out;
}

/* lst = d[key] (a new list there if none), then lst.append(item); steals item. */
static int append_at(PyObject *d, PyObject *key, PyObject *item) {
    if (item == NULL) return -1;
    PyObject *lst = PyDict_GetItemWithError(d, key);
    if (lst == NULL) {
        if (PyErr_Occurred()) goto fail;
        lst = PyList_New(0);
        if (lst == NULL) goto fail;
        int rc = PyDict_SetItem(d, key, lst);
        Py_DECREF(lst);
        if (rc < 0) goto fail;
    }
    int rc = PyList_Append(lst, item);
    Py_DECREF(item);
    return rc;
fail:
    Py_DECREF(item);
    return -1;
}

/* Whether ``inside(ns)`` holds (``inside`` None: always): 1, 0, or -1 on an error. */
static int is_inside(PyObject *inside, int64_t ns) {
    if (inside == Py_None) return 1;
    PyObject *arg = PyLong_FromLongLong(ns);
    if (arg == NULL) return -1;
    PyObject *r = PyObject_CallOneArg(inside, arg);
    Py_DECREF(arg);
    if (r == NULL) return -1;
    int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    return truth;
}

/* Whether two ids (a pid, a tid) are equal as a dict key compares them: 1 or 0 (an error
 * comparing them is a miss, and the lookup that follows meets it again). */
static int same(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    int eq = PyObject_RichCompareBool(a, b, Py_EQ);
    if (eq < 0) PyErr_Clear();
    return eq > 0;
}

/* A slice's item ``(start_ns, -end_ns, index)``: a new reference, NULL on an error. */
static PyObject *item_of(int64_t start, int64_t end, Py_ssize_t i) {
    PyObject *a = PyLong_FromLongLong(start), *b = PyLong_FromLongLong(-end),
             *c = PyLong_FromSsize_t(i);
    PyObject *t = a != NULL && b != NULL && c != NULL ? PyTuple_Pack(3, a, b, c) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    return t;
}

static PyObject *slices(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError,
                        "slices(events, lo, hi, seg, base, inside, gpu_cats, items, gpu, "
                        "correlated, flows, flow_point, max_ns)");
        return NULL;
    }
    PyObject *events = a[0], *seg = a[3], *inside = a[5], *gpu_cats = a[6], *items = a[7],
             *gpu = a[8], *correlated = a[9], *flows = a[10], *flow_point = a[11];
    if (!PyList_CheckExact(events) || !PyDict_Check(items) || !PyDict_Check(correlated) ||
        !PySet_Check(gpu) || !PyList_Check(flows)) {
        PyErr_SetString(PyExc_TypeError, "slices: events list, items dict, gpu set, "
                                         "correlated dict, flows list");
        return NULL;
    }
    Py_ssize_t lo = PyLong_AsSsize_t(a[1]), hi = PyLong_AsSsize_t(a[2]);
    int overflow = 0;
    long long base = PyLong_AsLongLongAndOverflow(a[4], &overflow);
    long long max_ns = PyLong_AsLongLong(a[12]);
    if (PyErr_Occurred()) return NULL;
    if (hi > PyList_GET_SIZE(events)) hi = PyList_GET_SIZE(events);
    Py_ssize_t negative = 0, out_of_range = 0, i = lo;
    /* the thread of the last slice: events come in runs of one thread, whose key and list
     * are then reused rather than made and looked up again an event */
    struct { PyObject *pid, *tid, *key, *list; } last = {NULL, NULL, NULL, NULL};
    if (overflow) goto done;                   /* a base past int64: the Python pass's work */
    for (; i < hi; i++) {
        prefetch_ahead(events, i);
        PyObject *ev = PyList_GET_ITEM(events, i);
        if (!PyDict_CheckExact(ev)) break;
        PyObject *ph = PyDict_GetItemWithError(ev, s_ph);
        if (ph == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        if (!PyUnicode_CheckExact(ph) || PyUnicode_GET_LENGTH(ph) != 1 || !PyUnicode_IS_ASCII(ph))
            break;
        char p = (char)PyUnicode_1BYTE_DATA(ph)[0];
        int64_t t;
        PyObject *ts = PyDict_GetItemWithError(ev, s_ts);
        if (ts == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        if (!to_ns(ts, &t)) break;
        int64_t start;
        if (__builtin_add_overflow((int64_t)base, t, &start)) break;
        if (p == 'X') {
            PyObject *dur = get(ev, s_dur), *args;
            int64_t d = 0;
            if (dur == NULL) goto fail;
            if (dur != Py_None) {
                if (!to_ns(dur, &d)) break;          /* a zero of either kind gives 0 */
            }
            args = get(ev, s_args);
            if (args == NULL) goto fail;
            if (args != Py_None && !PyDict_CheckExact(args)) break;
            if (d < 0) {                             /* kept as an instant, and counted */
                negative++;
                d = 0;
            }
            int64_t end;
            if (start < 0 || __builtin_add_overflow(start, d, &end) || end > max_ns) {
                out_of_range++;
                continue;
            }
            int in = is_inside(inside, start);
            if (in < 0) goto fail;
            if (!in) continue;
            PyObject *pid = get(ev, s_pid), *tid;
            if (pid == NULL || (tid = get(ev, s_tid)) == NULL) goto fail;
            PyObject *key;
            if (last.key != NULL && same(pid, last.pid) && same(tid, last.tid)) {
                key = Py_NewRef(last.key);
                PyObject *item = item_of(start, end, i);
                if (item == NULL || PyList_Append(last.list, item) < 0) {
                    Py_XDECREF(item);
                    goto fail_key;
                }
                Py_DECREF(item);
            } else {
                key = PyTuple_Pack(2, pid, tid);
                if (key == NULL) goto fail;
                if (append_at(items, key, item_of(start, end, i)) < 0) goto fail_key;
                Py_XSETREF(last.key, Py_NewRef(key));
                last.pid = pid;
                last.tid = tid;
                last.list = PyDict_GetItemWithError(items, key);    /* borrowed: items keeps it */
                if (last.list == NULL) goto fail_key;
            }
            PyObject *cat = get(ev, s_cat);
            if (cat == NULL) goto fail_key;
            int on_gpu = PySequence_Contains(gpu_cats, cat);
            if (on_gpu < 0 || (on_gpu && PySet_Add(gpu, key) < 0)) goto fail_key;
            if (args != Py_None && PyDict_GET_SIZE(args) > 0) {
                PyObject *corr = get(args, s_corr);
                if (corr == NULL) goto fail_key;
                if (corr != Py_None) {
                    PyObject *ck = PyTuple_Pack(2, seg, corr), *at = PyLong_FromSsize_t(i);
                    int rc = ck == NULL || at == NULL ? -1
                             : append_at(correlated, ck, PyTuple_Pack(2, at, key));
                    Py_XDECREF(ck);
                    Py_XDECREF(at);
                    if (rc < 0) goto fail_key;
                }
            }
            Py_DECREF(key);
            continue;
        fail_key:
            Py_DECREF(key);
            goto fail;
        } else if (p == 's' || p == 't' || p == 'f') {
            if (start < 0 || start > max_ns) {
                out_of_range++;
                continue;
            }
            int in = is_inside(inside, start);
            if (in < 0) goto fail;
            if (!in) continue;
            PyObject *cat = get(ev, s_cat), *fid, *pid, *tid;
            if (cat == NULL || (fid = get(ev, s_id)) == NULL || (pid = get(ev, s_pid)) == NULL ||
                (tid = get(ev, s_tid)) == NULL)
                goto fail;
            PyObject *key = PyTuple_Pack(2, pid, tid);
            PyObject *ns = PyLong_FromLongLong(start);
            PyObject *point = NULL;
            if (key != NULL && ns != NULL) {
                PyObject *fields[6] = {seg, cat, fid, ph, key, ns};
                point = named_tuple(flow_point, fields, 6);
            }
            Py_XDECREF(key);
            Py_XDECREF(ns);
            if (point == NULL) goto fail;
            int rc = PyList_Append(flows, point);
            Py_DECREF(point);
            if (rc < 0) goto fail;
        } else {
            break;
        }
    }
done:
    Py_XDECREF(last.key);
    return Py_BuildValue("(nnn)", i, negative, out_of_range);
fail:
    Py_XDECREF(last.key);
    return NULL;
}

/* ``round(v * 1000)`` of ``float(v)`` where v is a finite float or an int a double holds
 * exactly (``exact_double``): 1 with *ns set, else 0 (the Python pass decides). */
static int float_ns(PyObject *v, int64_t *ns) {
    double x;
    if (!exact_double(v, &x)) return 0;
    double r = nearbyint(x * 1000.0);        /* halves to even, as round() */
    if (!(r >= -9.2e18 && r <= 9.2e18)) return 0;
    *ns = (int64_t)r;
    return 1;
}

/* ``is_graph_launch(str(ev.get("name", "")), cat, args)`` for a launch event: 1, 0, -1. */
static int graph_launch(PyObject *ev, PyObject *cat, PyObject *args, PyObject *names,
                        PyObject *cbids) {
    PyObject *name = PyDict_GetItemWithError(ev, s_name), *text;
    if (name == NULL && PyErr_Occurred()) return -1;
    text = name == NULL ? Py_NewRef(s_empty) : PyObject_Str(name);
    if (text == NULL) return -1;
    int hit = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(names) && !hit; k++) {
        Py_ssize_t m = PyUnicode_Tailmatch(text, PyTuple_GET_ITEM(names, k), 0, PY_SSIZE_T_MAX,
                                           -1);
        if (m < 0) {
            Py_DECREF(text);
            return -1;
        }
        hit = (int)m;
    }
    Py_DECREF(text);
    if (hit) return 1;
    int runtime = PyObject_RichCompareBool(cat, s_runtime, Py_EQ);
    if (runtime <= 0) return runtime;
    PyObject *cbid = args == NULL ? Py_None : get(args, s_cbid);
    return cbid == NULL ? -1 : PySequence_Contains(cbids, cbid);
}

/* ``is_graphed(args, graph)`` (args NULL: none): 1, 0, -1. */
static int graphed_work(PyObject *args, PyObject *graph, PyObject *node_id) {
    if (args == NULL) return 0;
    PyObject *node = get(args, s_node);
    if (node == NULL) return -1;
    if (node != Py_None) {
        int nonzero;
        if (PyLong_CheckExact(node)) {
            nonzero = PyObject_IsTrue(node);
        } else {                              /* a string, a float, a bool: graph_node_id */
            PyObject *r = PyObject_CallOneArg(node_id, args);
            if (r == NULL) return -1;
            nonzero = PyObject_RichCompareBool(r, k_zero, Py_NE);
            Py_DECREF(r);
        }
        if (nonzero != 0) return nonzero;
    }
    PyObject *corr = get(args, s_corr);
    if (corr == NULL) return -1;
    return PySequence_Contains(graph, corr);
}

/* The GpuOp of a GPU event whose fields are all plain (``python_op``): a new reference, or
 * Py_None borrowed where the Python pass must decide, NULL on an error. */
static PyObject *plain_op(PyObject *ev, PyObject *args, PyObject *cat, PyObject *rank,
                          long long base, int graphed, PyObject *op_type) {
    PyObject *ts = PyDict_GetItemWithError(ev, s_ts), *dur, *name, *stream;
    int64_t t, d = 0, start, end;
    long long st = -1;
    if (ts == NULL) return PyErr_Occurred() ? NULL : Py_None;
    if (!float_ns(ts, &t) || __builtin_add_overflow((int64_t)base, t, &start)) return Py_None;
    if ((dur = get(ev, s_dur)) == NULL) return NULL;
    if (dur != Py_None && !float_ns(dur, &d)) return Py_None;
    if (__builtin_add_overflow(start, d, &end)) return Py_None;
    if (args != NULL) {
        stream = PyDict_GetItemWithError(args, s_stream);
        if (stream == NULL && PyErr_Occurred()) return NULL;
        if (stream != NULL && !int64_of(stream, &st)) return Py_None;
    }
    name = PyDict_GetItemWithError(ev, s_name);
    if (name == NULL && PyErr_Occurred()) return NULL;
    if (name == NULL) name = s_empty;
    if (!PyUnicode_CheckExact(name)) return Py_None;
    PyObject *fields[7] = {rank, PyLong_FromLongLong(st), name, cat, PyLong_FromLongLong(start),
                           PyLong_FromLongLong(end), graphed ? Py_True : Py_False};
    PyObject *op = NULL;
    if (fields[1] != NULL && fields[4] != NULL && fields[5] != NULL)
        op = named_tuple(op_type, fields, 7);
    Py_XDECREF(fields[1]);
    Py_XDECREF(fields[4]);
    Py_XDECREF(fields[5]);
    return op;
}

/* gpu_index(events, joinable, consts, rank, base_ns, op_type, op_of, outs): fills outs =
 * (launches, graph, work, ops, graphed, other) as ``gpu.python_gpu_index`` builds them;
 * consts = (launch_cats, work_cats, graph_names, graph_cbids, graph_node_id). An event whose
 * GpuOp it cannot make exactly is ``op_of(index)``'s. */
static PyObject *gpu_index(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 8 || !PyList_CheckExact(a[1]) || !PyTuple_CheckExact(a[2]) ||
        PyTuple_GET_SIZE(a[2]) != 5 || !PyTuple_CheckExact(a[7]) || PyTuple_GET_SIZE(a[7]) != 6) {
        PyErr_SetString(PyExc_TypeError, "gpu_index(events, joinable list, consts (5), rank, "
                                         "base_ns, op_type, op_of, outs (6))");
        return NULL;
    }
    PyObject *events = a[0], *joinable = a[1], *rank = a[3], *op_type = a[5], *op_of = a[6];
    PyObject *launch_cats = PyTuple_GET_ITEM(a[2], 0), *work_cats = PyTuple_GET_ITEM(a[2], 1),
             *names = PyTuple_GET_ITEM(a[2], 2), *cbids = PyTuple_GET_ITEM(a[2], 3),
             *node_id = PyTuple_GET_ITEM(a[2], 4);
    PyObject *launches = PyTuple_GET_ITEM(a[7], 0), *graph = PyTuple_GET_ITEM(a[7], 1),
             *work = PyTuple_GET_ITEM(a[7], 2), *ops = PyTuple_GET_ITEM(a[7], 3),
             *graphed = PyTuple_GET_ITEM(a[7], 4), *other = PyTuple_GET_ITEM(a[7], 5);
    if (!PyDict_Check(launches) || !PySet_Check(graph) || !PyList_Check(work) ||
        !PyList_Check(ops) || !PySet_Check(graphed) || !PyList_Check(other) ||
        !PyTuple_Check(names)) {
        PyErr_SetString(PyExc_TypeError, "gpu_index: outs (dict, set, list, list, set, list)");
        return NULL;
    }
    int overflow = 0;
    long long base = PyLong_AsLongLongAndOverflow(a[4], &overflow);
    if (base == -1 && PyErr_Occurred()) return NULL;
    int ahead = PyList_CheckExact(events);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(joinable); j++) {
        if (ahead) prefetch_indexed(events, joinable, j);
        PyObject *idx = PyList_GET_ITEM(joinable, j);
        PyObject *ev = PyObject_GetItem(events, idx);
        if (ev == NULL) return NULL;
        int rc = 0;
        if (PyDict_CheckExact(ev)) {
            PyObject *ph = get(ev, s_ph), *cat;
            int is_x = ph == NULL ? -1 : PyObject_RichCompareBool(ph, s_X, Py_EQ);
            if (is_x <= 0) {
                rc = is_x;
            } else if ((cat = get(ev, s_cat)) == NULL) {
                rc = -1;
            } else {
                int in_launch = 0, in_work = 0;
                if (PyUnicode_CheckExact(cat)) {
                    in_launch = PySequence_Contains(launch_cats, cat);
                    if (in_launch == 0) in_work = PySequence_Contains(work_cats, cat);
                }
                if (in_launch < 0 || in_work < 0) {
                    rc = -1;
                } else if (in_launch) {
                    PyObject *args = get(ev, s_args), *corr = Py_None;
                    if (args == NULL) {
                        rc = -1;
                    } else if (PyDict_CheckExact(args)) {
                        corr = get(args, s_corr);
                    } else {
                        args = NULL;
                    }
                    if (corr == NULL) {
                        rc = -1;
                    } else if (rc == 0 && corr != Py_None) {
                        rc = PyDict_SetItem(launches, corr, idx);
                        int g = rc < 0 ? 0 : graph_launch(ev, cat, args, names, cbids);
                        if (g < 0 || (g > 0 && PySet_Add(graph, corr) < 0)) rc = -1;
                    }
                } else {
                    rc = PyList_Append(in_work ? work : other, idx);
                }
            }
        }
        Py_DECREF(ev);
        if (rc < 0) return NULL;
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(work); j++) {
        if (ahead) prefetch_indexed(events, work, j);
        PyObject *idx = PyList_GET_ITEM(work, j);
        PyObject *ev = PyObject_GetItem(events, idx), *args, *op = NULL;
        if (ev == NULL) return NULL;
        if ((args = get(ev, s_args)) == NULL) goto fail;
        if (!PyDict_CheckExact(args)) args = NULL;
        int g = graphed_work(args, graph, node_id);
        if (g < 0 || (g > 0 && PySet_Add(graphed, idx) < 0)) goto fail;
        op = overflow ? Py_None : plain_op(ev, args, get(ev, s_cat), rank, base, g, op_type);
        if (op == Py_None) op = PyObject_CallOneArg(op_of, idx);     /* Python decides */
        if (op == NULL || PyList_Append(ops, op) < 0) goto fail;
        Py_DECREF(op);
        Py_DECREF(ev);
        continue;
    fail:
        Py_XDECREF(op);
        Py_DECREF(ev);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The slice of the (index, track) ``pairs`` of a correlation id on ``key``'s track, where the
 * pairs put at most one slice on each track (``flows.Binder.by_correlation`` then needs no
 * choosing): a borrowed index, Py_None where the pass must leave the flow to Python, NULL on
 * an error. */
static PyObject *only_carrier(PyObject *pairs, PyObject *key) {
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    PyObject *hit = Py_None;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *pair = PyList_GET_ITEM(pairs, k);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) return Py_None;
        int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(pair, 1), key, Py_EQ);
        if (eq < 0) return NULL;
        if (eq) {
            if (hit != Py_None) return Py_None;      /* two on the track: Python chooses */
            hit = PyTuple_GET_ITEM(pair, 0);
        }
    }
    return hit;
}

/* bind_flows(points, correlated, launch_cat, bind_flow, launch_segments, sources, targets):
 * ``flows.Binder.bind``'s loop. The points grouped into flows by (seg, cat, id), in order; a
 * launch flow (``launch_cat``) whose every point has exactly one slice with its id on its
 * track is bound here, every other flow by ``bind_flow(ident, points, sources, targets)``. */
static PyObject *bind_flows(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 7 || !PyList_CheckExact(a[0]) || !PyDict_Check(a[1]) || !PySet_Check(a[4]) ||
        !PyDict_Check(a[5]) || !PyDict_Check(a[6])) {
        PyErr_SetString(PyExc_TypeError, "bind_flows(points list, correlated dict, launch_cat, "
                                         "bind_flow, launch_segments set, sources dict, "
                                         "targets dict)");
        return NULL;
    }
    PyObject *points = a[0], *correlated = a[1], *launch_cat = a[2], *bind_flow = a[3],
             *segments = a[4], *sources = a[5], *targets = a[6];
    PyObject *flows = PyDict_New(), *ident = NULL, *pts, *found = NULL;
    if (flows == NULL) return NULL;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(points); k++) {
        PyObject *p = PyList_GET_ITEM(points, k);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 6) {
            PyErr_SetString(PyExc_TypeError, "bind_flows: a point is a FlowPoint");
            goto fail;
        }
        ident = PyTuple_Pack(3, PyTuple_GET_ITEM(p, 0), PyTuple_GET_ITEM(p, 1),
                             PyTuple_GET_ITEM(p, 2));
        if (ident == NULL) goto fail;
        Py_INCREF(p);
        if (append_at(flows, ident, p) < 0) goto fail;
        Py_CLEAR(ident);
    }
    Py_ssize_t pos = 0;
    while (PyDict_Next(flows, &pos, &ident, &pts)) {
        Py_INCREF(ident);
        Py_INCREF(pts);
        Py_ssize_t n = PyList_GET_SIZE(pts);
        int fast = PyObject_RichCompareBool(PyTuple_GET_ITEM(ident, 1), launch_cat, Py_EQ);
        if (fast < 0) goto fail_flow;
        PyObject *pairs = NULL;
        if (fast) {
            PyObject *ck = PyTuple_Pack(2, PyTuple_GET_ITEM(ident, 0), PyTuple_GET_ITEM(ident, 2));
            if (ck == NULL) goto fail_flow;
            pairs = PyDict_GetItemWithError(correlated, ck);
            Py_DECREF(ck);
            if (pairs == NULL && PyErr_Occurred()) goto fail_flow;
            fast = pairs != NULL && PyList_CheckExact(pairs) && PyList_GET_SIZE(pairs) <= 4;
        }
        if (fast) {
            found = PyList_New(n);
            if (found == NULL) goto fail_flow;
            for (Py_ssize_t k = 0; k < n && fast; k++) {
                PyObject *hit = only_carrier(pairs, PyTuple_GET_ITEM(PyList_GET_ITEM(pts, k), 4));
                if (hit == NULL) goto fail_flow;
                Py_INCREF(hit);
                PyList_SET_ITEM(found, k, hit);
                fast = hit != Py_None;
            }
        }
        if (fast) {
            if (PySet_Add(segments, PyTuple_GET_ITEM(ident, 0)) < 0) goto fail_flow;
            for (Py_ssize_t k = 0; k < n; k++) {
                PyObject *ph = PyTuple_GET_ITEM(PyList_GET_ITEM(pts, k), 3);
                PyObject *index = PyList_GET_ITEM(found, k);
                int is_s = PyObject_RichCompareBool(ph, s_s, Py_EQ);
                if (is_s < 0) goto fail_flow;
                if (is_s) {
                    PyObject *had = PyDict_SetDefault(sources, ident, index);
                    if (had == NULL) goto fail_flow;
                } else {
                    Py_INCREF(index);
                    if (append_at(targets, ident, index) < 0) goto fail_flow;
                }
            }
        } else {
            PyObject *args[4] = {ident, pts, sources, targets};
            PyObject *r = PyObject_Vectorcall(bind_flow, args, 4, NULL);
            if (r == NULL) goto fail_flow;
            Py_DECREF(r);
        }
        Py_CLEAR(found);
        Py_DECREF(ident);
        Py_DECREF(pts);
        continue;
    fail_flow:
        Py_XDECREF(found);
        Py_DECREF(ident);
        Py_DECREF(pts);
        Py_DECREF(flows);
        return NULL;
    }
    Py_DECREF(flows);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(ident);
    Py_DECREF(flows);
    return NULL;
}

/* ---- shapes_as_text: op-shape args as the text the pftrace writer makes of them ---------- */

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The list value at ``p`` (its '['), when it holds only ints of at most 18 digits, printable
 * ASCII strings without a backslash, true, false, null and such lists, and is valid JSON: its
 * end (past the ']'). NULL for any other list (a float, an escape, a big int, bad JSON, one
 * cut off by ``end``): that one stays as it is. */
static const char *plain_list(const char *p, const char *end) {
    enum { VALUE_OR_CLOSE, VALUE, COMMA_OR_CLOSE } want = VALUE_OR_CLOSE;
    Py_ssize_t depth = 0;
    while (p < end) {
        char c = *p;
        if (is_ws(c)) {
            p++;
            continue;
        }
        if (c == ']') {
            if (want == VALUE) return NULL;
            p++;
            if (--depth == 0) return p;
            want = COMMA_OR_CLOSE;
            continue;
        }
        if (c == ',') {
            if (want != COMMA_OR_CLOSE) return NULL;
            p++;
            want = VALUE;
            continue;
        }
        if (want == COMMA_OR_CLOSE) return NULL;
        if (c == '[') {
            p++, depth++;
            want = VALUE_OR_CLOSE;
            continue;
        }
        if (depth == 0) return NULL;
        if (c == '"') {
            for (p++; p < end && *p != '"'; p++)
                if (*p == '\\' || *p < 0x20 || *p > 0x7e) return NULL;
            if (p == end) return NULL;
            p++;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            if (c == '-') p++;
            const char *d = p;
            while (p < end && *p >= '0' && *p <= '9') p++;
            Py_ssize_t digits = p - d;
            if (digits == 0 || digits > 18 || (d[0] == '0' && digits > 1)
                || (c == '-' && digits == 1 && d[0] == '0'))
                return NULL;                /* not JSON, past int64, or -0 (which reads as 0) */
            if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) return NULL;
        } else {
            static const char *const words[] = {"true", "false", "null"};
            Py_ssize_t k = 0, w = 0;
            for (; w < 3; w++) {
                k = (Py_ssize_t)strlen(words[w]);
                if (end - p >= k && memcmp(p, words[w], k) == 0) break;
            }
            if (w == 3) return NULL;
            p += k;
        }
        want = COMMA_OR_CLOSE;
    }
    return NULL;
}

/* The compact text of a list ``plain_list`` took, as a JSON string's contents. */
static char *write_list(char *w, const char *p, const char *stop) {
    while (p < stop) {
        char c = *p;
        if (c == '"') {
            const char *q = memchr(p + 1, '"', stop - p - 1);
            *w++ = '\\', *w++ = '"';
            memcpy(w, p + 1, q - p - 1);
            w += q - p - 1;
            *w++ = '\\', *w++ = '"';
            p = q + 1;
        } else {
            if (!is_ws(c)) *w++ = c;
            p++;
        }
    }
    return w;
}

/* Whether the '[' at ``p`` is the value of a key among ``keys`` (a tuple of bytes): a
 * ``"key"`` after '{' or ',' and before ':'. Inside a JSON string every quote is escaped, so
 * a quote next to the key's bytes there is never taken for one. */
static int shape_key(const char *start, const char *p, PyObject *keys, Py_ssize_t longest) {
    const char *q = p - 1;
    while (q > start && is_ws(*q)) q--;
    if (q <= start || *q != ':') return 0;
    q--;
    while (q > start && is_ws(*q)) q--;
    if (q <= start || *q != '"') return 0;
    const char *close = q, *open = NULL;
    for (q = close - 1; q >= start && close - q <= longest + 1; q--)
        if (*q == '"') {
            open = q;
            break;
        }
    if (open == NULL) return 0;
    const char *b = open - 1;
    while (b > start && is_ws(*b)) b--;
    if (b < start || (*b != '{' && *b != ',')) return 0;
    Py_ssize_t klen = close - open - 1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys); k++) {
        PyObject *key = PyTuple_GET_ITEM(keys, k);
        if (PyBytes_GET_SIZE(key) == klen && memcmp(PyBytes_AS_STRING(key), open + 1, klen) == 0)
            return 1;
    }
    return 0;
}

/* shapes_into(out, data, keys): ``data`` (any bytes-like) appended to the bytearray ``out``
 * with every plain list value of those keys (a tuple of bytes) made the string of its compact
 * text (``[[4, 2], []]`` -> ``"[[4,2],[]]"``): what ``orjson.dumps`` makes of the list, and
 * the writer writes. A list cut off by the end of ``data`` stays as it is. */
static PyObject *shapes_into(PyObject *self, PyObject *args) {
    PyObject *out, *keys;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "O!y*O!", &PyByteArray_Type, &out, &view, &PyTuple_Type, &keys))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t longest = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys); k++) {
        PyObject *key = PyTuple_GET_ITEM(keys, k);
        if (!PyBytes_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "commviz: shape keys are bytes");
            goto done;
        }
        if (PyBytes_GET_SIZE(key) > longest) longest = PyBytes_GET_SIZE(key);
    }
    /* room for the worst case, a list's text at most doubling; only what is written is used */
    Py_ssize_t had = PyByteArray_GET_SIZE(out);
    if (view.len > (PY_SSIZE_T_MAX - had - 2) / 2) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyByteArray_Resize(out, had + 2 * view.len + 2) < 0) goto done;
    char *base = PyByteArray_AS_STRING(out), *w = base + had;
    const char *start = view.buf, *end = start + view.len, *copied = start, *p = start;
    while (p < end && (p = memchr(p, '[', end - p)) != NULL) {
        const char *stop;
        if (!shape_key(start, p, keys, longest) || (stop = plain_list(p, end)) == NULL) {
            p++;
            continue;
        }
        memcpy(w, copied, p - copied);
        w += p - copied;
        *w++ = '"';
        w = write_list(w, p, stop);
        *w++ = '"';
        copied = p = stop;
    }
    memcpy(w, copied, end - copied);
    w += end - copied;
    if (PyByteArray_Resize(out, w - base) < 0) goto done;
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&view);
    return result;
}

/* ``commviz.merge.flows.python_back_links`` into ``back`` (an array('q') of len(items)):
 * each (start, -end, index) item's nearest earlier item that ends later, or -1. None where
 * an item is no tuple or its -end no int64: Python then writes the whole of ``back``. */
static PyObject *back_links(PyObject *self, PyObject *args) {
    PyObject *items, *out, *result = NULL;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &items, &out)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    int64_t *neg = NULL;
    Py_ssize_t *later = NULL, depth = 0;
    if (view.itemsize != 8 || view.len != n * 8 || view.format == NULL
        || strcmp(view.format, "q") != 0) {
        PyErr_SetString(PyExc_TypeError, "back_links: back must be an array('q') of len(items)");
        goto done;
    }
    neg = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *neg);
    later = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *later);
    if (neg == NULL || later == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *back = view.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *item = PyList_GET_ITEM(items, j);
        int overflow = 0;
        long long v = -1;
        if (PyTuple_CheckExact(item) && PyTuple_GET_SIZE(item) >= 2
            && PyLong_CheckExact(PyTuple_GET_ITEM(item, 1)))
            v = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(item, 1), &overflow);
        else
            overflow = 1;
        if (overflow) {                 /* left to Python, whole */
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
        neg[j] = v;
        while (depth && neg[later[depth - 1]] >= v) depth--;
        back[j] = depth ? (int64_t)later[depth - 1] : -1;
        later[depth++] = j;
    }
    result = Py_True;
    Py_INCREF(result);
done:
    PyMem_Free(neg);
    PyMem_Free(later);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"index_events", index_events, METH_VARARGS,
     "index_events(events, join_cats, named_prefixes) -> the joinable indices"},
    {"time_bounds", time_bounds, METH_O,
     "time_bounds(events) -> (lo, hi, longest, shortest) of the timed events, or None"},
    {"scan_loaded", scan_loaded, METH_VARARGS,
     "scan_loaded(events, join_cats, named_prefixes) -> (index_events(...), time_bounds(...))"},
    {"slices", (PyCFunction)(void (*)(void))slices, METH_FASTCALL,
     "slices(...) -> (stop, negative, out_of_range): _Layout's pass up to an event it leaves "
     "to Python"},
    {"bind_flows", (PyCFunction)(void (*)(void))bind_flows, METH_FASTCALL,
     "bind_flows(points, correlated, launch_cat, bind_flow, launch_segments, sources, "
     "targets): flows.Binder.bind's loop"},
    {"gpu_index", (PyCFunction)(void (*)(void))gpu_index, METH_FASTCALL,
     "gpu_index(events, joinable, consts, rank, base_ns, op_type, op_of, outs): "
     "gpu.python_gpu_index's pass, into outs"},
    {"back_links", back_links, METH_VARARGS,
     "back_links(items, back) -> True, or None where Python must: flows.python_back_links"},
    {"shapes_into", shapes_into, METH_VARARGS,
     "shapes_into(out, data, keys): data appended to out, those keys' plain list values as "
     "their compact JSON text"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__scan(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {{&s_pid, "pid"}, {&s_tid, "tid"}, {&s_ph, "ph"},     {&s_cat, "cat"},
                 {&s_name, "name"}, {&s_ts, "ts"}, {&s_dur, "dur"},   {&s_args, "args"},
                 {&s_corr, "correlation"}, {&s_id, "id"}, {&s_X, "X"}, {&s_M, "M"},
                 {&s_node, "graph node id"}, {&s_stream, "stream"}, {&s_cbid, "cbid"},
                 {&s_runtime, "cuda_runtime"}, {&s_empty, ""}, {&s_s, "s"}};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        *names[k].slot = PyUnicode_InternFromString(names[k].text);
        if (*names[k].slot == NULL) return NULL;
    }
    k_zero = PyLong_FromLong(0);
    k_zero_f = PyFloat_FromDouble(0.0);
    if (k_zero == NULL || k_zero_f == NULL) return NULL;
    return PyModule_Create(&module);
}
