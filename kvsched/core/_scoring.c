/* Compiled per-instance scoring: the vector arithmetic a placement decision runs over every
 * instance slot (estimated TTFT terms, prefix fetches, masked minima and argmins), one C loop
 * instead of a dozen numpy calls of a microsecond each.
 *
 * `kvsched.core.scoring.PyKernels` is the reference: every function here computes what its
 * numpy counterpart computes, bit for bit. That holds because each element is evaluated with
 * the same IEEE double operations in the same order as numpy's elementwise ufuncs (this file is
 * compiled with -ffp-contract=off, so no multiply-add is fused), and no floating-point sum is
 * taken (minima, comparisons and selections are exact in any order). NaN propagates as numpy's
 * maximum and clip propagate it.
 *
 * Vectors are read and written through the buffer protocol (1-D, C-contiguous float64 "d" or
 * bool "?"), so no numpy headers are needed to build; outputs are made with numpy.empty. A
 * function given a vector of another kind returns NotImplemented and the caller computes the
 * reference instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

static PyObject *np_empty;      /* numpy.empty */
static PyObject *np_bool;       /* numpy.bool_ */
static PyObject *dtype_kwnames; /* ("dtype",) */

/* ---- vectors ------------------------------------------------------------------------------ */

enum { UNSUPPORTED = -2 };

/* A read or written vector: its buffer and data. */
typedef struct {
    Py_buffer buf;
    int held;
} Vec;

/* Open `obj` as a 1-D C-contiguous vector of `kind` ('d' or '?') and `n` items (n < 0: any
 * length, set into *n_out). Returns 0, UNSUPPORTED (not such a vector; no error set) or -1
 * (error set). */
static int vec_open(PyObject *obj, Vec *v, char kind, Py_ssize_t n, Py_ssize_t *n_out) {
    v->held = 0;
    /* Inputs are only read; outputs are arrays this module just made, so writing them is
     * safe without asking for a writable buffer. */
    if (PyObject_GetBuffer(obj, &v->buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return UNSUPPORTED;
    }
    v->held = 1;
    Py_ssize_t size = kind == 'd' ? 8 : 1;
    const char *fmt = v->buf.format;
    if (v->buf.ndim != 1 || v->buf.itemsize != size || fmt == NULL || fmt[0] != kind ||
        fmt[1] != '\0') {
        PyBuffer_Release(&v->buf);
        v->held = 0;
        return UNSUPPORTED;
    }
    Py_ssize_t len = v->buf.shape[0];
    if (n >= 0 && len != n) {
        PyBuffer_Release(&v->buf);
        v->held = 0;
        PyErr_Format(PyExc_ValueError, "vectors of %zd and %zd slots", n, len);
        return -1;
    }
    if (n_out != NULL) {
        *n_out = len;
    }
    return 0;
}

static void vec_close(Vec *v) {
    if (v->held) {
        PyBuffer_Release(&v->buf);
        v->held = 0;
    }
}

static inline double *dvec(Vec *v) { return (double *)v->buf.buf; }
static inline const char *bvec(Vec *v) { return (const char *)v->buf.buf; }

/* A fresh numpy array of n float64 (kind 'd') or bool ('?'), opened as `v`. */
static PyObject *vec_new(Py_ssize_t n, char kind, Vec *v) {
    PyObject *size = PyLong_FromSsize_t(n);
    if (size == NULL) {
        return NULL;
    }
    PyObject *arr;
    if (kind == 'd') {
        arr = PyObject_CallOneArg(np_empty, size);
    } else {
        PyObject *args[2] = {size, np_bool};
        arr = PyObject_Vectorcall(np_empty, args, 1, dtype_kwnames);
    }
    Py_DECREF(size);
    if (arr == NULL) {
        return NULL;
    }
    int rc = vec_open(arr, v, kind, n, NULL);
    if (rc != 0) {
        Py_DECREF(arr);
        if (rc == UNSUPPORTED) {
            PyErr_SetString(PyExc_RuntimeError, "numpy.empty made no C-contiguous vector");
        }
        return NULL;
    }
    return arr;
}

/* numpy's maximum and clip(lower=0) for doubles: NaN propagates; otherwise the larger (the
 * first on ties, as numpy's loop keeps it). */
static inline double np_max(double a, double b) {
    if (isnan(a)) {
        return a;
    }
    if (isnan(b)) {
        return b;
    }
    return a >= b ? a : b;
}

/* np.clip(a, 0.0, None), which numpy computes as maximum(a, 0.0). */
static inline double np_clip_low0(double a) { return np_max(a, 0.0); }

/* The fitted step-time constants a TTFT estimate reads (`CostModel.kernel_constants`). */
typedef struct {
    double step_s, decode_seq_s, decode_ctx_s, prefill_token_s, attn_pair_s, chunk;
    double kv_bytes_per_token;
} Constants;

static int read_constants(PyObject *obj, Constants *c) {
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 7) {
        PyErr_SetString(PyExc_TypeError, "constants: a tuple of 7 numbers");
        return -1;
    }
    double *out[7] = {&c->step_s,          &c->decode_seq_s, &c->decode_ctx_s,
                      &c->prefill_token_s, &c->attn_pair_s,  &c->chunk,
                      &c->kv_bytes_per_token};
    for (int i = 0; i < 7; i++) {
        double v = PyFloat_AsDouble(PyTuple_GET_ITEM(obj, i));
        if (v == -1.0 && PyErr_Occurred()) {
            return -1;
        }
        *out[i] = v;
    }
    return 0;
}

/* A transfer matrix row: `matrix` is an n x n C-contiguous float64 buffer. */
static int row_open(PyObject *matrix, Vec *v, Py_ssize_t n, Py_ssize_t src, const double **row) {
    v->held = 0;
    if (PyObject_GetBuffer(matrix, &v->buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return UNSUPPORTED;
    }
    v->held = 1;
    const char *fmt = v->buf.format;
    if (v->buf.ndim != 2 || v->buf.itemsize != 8 || fmt == NULL || fmt[0] != 'd' ||
        fmt[1] != '\0' || v->buf.shape[0] != n || v->buf.shape[1] != n) {
        vec_close(v);
        return UNSUPPORTED;
    }
    if (src < 0 || src >= n) {
        vec_close(v);
        PyErr_Format(PyExc_IndexError, "slot %zd of %zd", src, n);
        return -1;
    }
    *row = (const double *)v->buf.buf + src * n;
    return 0;
}

/* CostModel.transfer_from for one slot: seconds to move `tokens` from the row's source. */
static inline double transfer_one(double tokens, double kv, double setup, double per_byte) {
    double nbytes = tokens * kv;
    double moving = setup + nbytes * per_byte;
    return tokens > 0 ? moving : 0.0;
}

/* LatencyModel.prefill(n_new, n_cached, chunk) for one slot. */
static inline double prefill_one(const Constants *c, double n_new, double n_cached) {
    double passes = 1.0;
    if (c->chunk > 0) {
        passes = np_max(ceil(n_new / c->chunk), 1.0);
    }
    double a = c->step_s * passes;
    double b = c->prefill_token_s * n_new;
    double attn = c->attn_pair_s * n_new;
    double pairs = n_cached + n_new * 0.5;
    return (a + b) + attn * pairs;
}

static PyObject *tuple_steal(Py_ssize_t n, PyObject **items) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_XDECREF(items[i]);
        }
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    return t;
}

static int slot_arg(PyObject *obj, Py_ssize_t n, Py_ssize_t *slot) {
    /* Any integer (numpy's too), as numpy's indexing takes it. */
    Py_ssize_t s = PyNumber_AsSsize_t(obj, PyExc_IndexError);
    if (s == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (s < 0 || s >= n) {
        PyErr_Format(PyExc_IndexError, "slot %zd of %zd", s, n);
        return -1;
    }
    *slot = s;
    return 0;
}

#define CHECK_ARGS(name, want)                                                              \
    if (nargs != (want)) {                                                                  \
        PyErr_Format(PyExc_TypeError, name " takes %d arguments (%zd given)", (want), nargs); \
        return NULL;                                                                        \
    }

/* ---- ttft ---------------------------------------------------------------------------------- */

/* ttft(prompt_tokens, cached, running, decode_tokens, queue, transfer|None, constants)
 *   -> (prefill, transfer, ttft). `transfer` is returned as given, or a new zero vector. */
static PyObject *ttft(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("ttft", 7)
    double prompt = PyFloat_AsDouble(args[0]);
    if (prompt == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Constants c;
    if (read_constants(args[6], &c) < 0) {
        return NULL;
    }
    Vec in[5] = {0};
    Vec out[3] = {0};
    PyObject *res[3] = {NULL, NULL, NULL};
    PyObject *result = NULL;
    Py_ssize_t n = -1;
    int has_transfer = args[5] != Py_None;
    int rc = vec_open(args[1], &in[0], 'd', -1, &n);
    for (int i = 1; rc == 0 && i < 4; i++) {
        rc = vec_open(args[i + 1], &in[i], 'd', n, NULL);
    }
    if (rc == 0 && has_transfer) {
        rc = vec_open(args[5], &in[4], 'd', n, NULL);
    }
    if (rc == UNSUPPORTED) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (rc < 0) {
        goto done;
    }
    if ((res[0] = vec_new(n, 'd', &out[0])) == NULL) {
        goto done;
    }
    if (has_transfer) {
        res[1] = Py_NewRef(args[5]);
    } else {
        if ((res[1] = vec_new(n, 'd', &out[1])) == NULL) {
            goto done;
        }
        memset(dvec(&out[1]), 0, (size_t)n * sizeof(double));
    }
    if ((res[2] = vec_new(n, 'd', &out[2])) == NULL) {
        goto done;
    }
    const double *cached = dvec(&in[0]), *running = dvec(&in[1]);
    const double *decode = dvec(&in[2]), *queue = dvec(&in[3]);
    const double *transfer = has_transfer ? dvec(&in[4]) : NULL;
    double *prefill = dvec(&out[0]), *est = dvec(&out[2]);
    for (Py_ssize_t j = 0; j < n; j++) {
        /* cost.ttft_terms, operation by operation as numpy evaluates it. */
        double n_new = prompt - cached[j];
        double per_pass = (c.step_s + c.decode_seq_s * running[j]) + c.decode_ctx_s * decode[j];
        double passes = np_max(ceil(n_new / c.chunk), 1.0);
        double pairs = cached[j] + n_new * 0.5;
        double per_token = c.prefill_token_s + c.attn_pair_s * pairs;
        prefill[j] = passes * per_pass + n_new * per_token;
        est[j] = (queue[j] + prefill[j]) + (transfer ? transfer[j] : 0.0);
    }
    result = tuple_steal(3, res);
    res[0] = res[1] = res[2] = NULL;
done:
    for (int i = 0; i < 5; i++) {
        vec_close(&in[i]);
    }
    for (int i = 0; i < 3; i++) {
        vec_close(&out[i]);
        Py_XDECREF(res[i]);
    }
    return result;
}

/* ---- moving a host's prefix ------------------------------------------------------------------ */

/* moving(host, hits, setup, per_byte, kv_bytes_per_token) -> (cached, transfer): every slot
 * after the host's part of the prompt moved there (cost.moving_terms before its TTFT). */
static PyObject *moving(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("moving", 5)
    double kv = PyFloat_AsDouble(args[4]);
    if (kv == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Vec hv = {0}, sv = {0}, pv = {0}, out[2] = {0};
    PyObject *res[2] = {NULL, NULL};
    PyObject *result = NULL;
    Py_ssize_t n = -1, host;
    const double *setup = NULL, *per_byte = NULL;
    int rc = vec_open(args[1], &hv, 'd', -1, &n);
    if (rc == 0 && slot_arg(args[0], n, &host) < 0) {
        rc = -1;
    }
    if (rc == 0) {
        rc = row_open(args[2], &sv, n, host, &setup);
    }
    if (rc == 0) {
        rc = row_open(args[3], &pv, n, host, &per_byte);
    }
    if (rc == UNSUPPORTED) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (rc < 0) {
        goto done;
    }
    if ((res[0] = vec_new(n, 'd', &out[0])) == NULL ||
        (res[1] = vec_new(n, 'd', &out[1])) == NULL) {
        goto done;
    }
    const double *hits = dvec(&hv);
    double *cached = dvec(&out[0]), *transfer = dvec(&out[1]);
    double held = hits[host];
    for (Py_ssize_t j = 0; j < n; j++) {
        double moved = np_clip_low0(held - hits[j]);
        cached[j] = np_max(hits[j], held);
        transfer[j] = transfer_one(moved, kv, setup[j], per_byte[j]);
    }
    result = tuple_steal(2, res);
    res[0] = res[1] = NULL;
done:
    vec_close(&hv);
    vec_close(&sv);
    vec_close(&pv);
    for (int i = 0; i < 2; i++) {
        vec_close(&out[i]);
        Py_XDECREF(res[i]);
    }
    return result;
}

/* ---- fetching a prefix from its holder ------------------------------------------------------- */

/* fetch_when_cheaper(holder, prompt_tokens, hits, eligible, setup, per_byte, constants,
 *   holder_prefill_s) -> (fetch, cached, transfer): cost.fetch_when_cheaper. */
static PyObject *fetch_when_cheaper(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("fetch_when_cheaper", 8)
    double prompt = PyFloat_AsDouble(args[1]);
    if (prompt == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    double own = PyFloat_AsDouble(args[7]);
    if (own == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Constants c;
    if (read_constants(args[6], &c) < 0) {
        return NULL;
    }
    Vec hv = {0}, ev = {0}, sv = {0}, pv = {0}, out[3] = {0};
    PyObject *res[3] = {NULL, NULL, NULL};
    PyObject *result = NULL;
    Py_ssize_t n = -1, holder;
    const double *setup = NULL, *per_byte = NULL;
    int rc = vec_open(args[2], &hv, 'd', -1, &n);
    if (rc == 0) {
        rc = vec_open(args[3], &ev, '?', n, NULL);
    }
    if (rc == 0 && slot_arg(args[0], n, &holder) < 0) {
        rc = -1;
    }
    if (rc == 0) {
        rc = row_open(args[4], &sv, n, holder, &setup);
    }
    if (rc == 0) {
        rc = row_open(args[5], &pv, n, holder, &per_byte);
    }
    if (rc == UNSUPPORTED) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (rc < 0) {
        goto done;
    }
    if ((res[0] = vec_new(n, '?', &out[0])) == NULL ||
        (res[1] = vec_new(n, 'd', &out[1])) == NULL ||
        (res[2] = vec_new(n, 'd', &out[2])) == NULL) {
        goto done;
    }
    const double *hits = dvec(&hv);
    const char *eligible = bvec(&ev);
    char *fetch = (char *)out[0].buf.buf;
    double *cached = dvec(&out[1]), *transfer = dvec(&out[2]);
    double held = hits[holder];
    for (Py_ssize_t j = 0; j < n; j++) {
        double extra = np_clip_low0(held - hits[j]);
        double fetch_s = transfer_one(extra, c.kv_bytes_per_token, setup[j], per_byte[j]);
        double saved = prefill_one(&c, prompt - hits[j], hits[j]) - own;
        int f = eligible[j] && extra > 0 && fetch_s < saved;
        fetch[j] = (char)f;
        cached[j] = f ? held : hits[j];
        transfer[j] = f ? fetch_s : 0.0;
    }
    result = tuple_steal(3, res);
    res[0] = res[1] = res[2] = NULL;
done:
    vec_close(&hv);
    vec_close(&ev);
    vec_close(&sv);
    vec_close(&pv);
    for (int i = 0; i < 3; i++) {
        vec_close(&out[i]);
        Py_XDECREF(res[i]);
    }
    return result;
}

/* fetch_from(holder, hits, fetch, setup, per_byte, kv_bytes_per_token) -> (cached, transfer):
 * cost.fetch_from. */
static PyObject *fetch_from(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("fetch_from", 6)
    double kv = PyFloat_AsDouble(args[5]);
    if (kv == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Vec hv = {0}, fv = {0}, sv = {0}, pv = {0}, out[2] = {0};
    PyObject *res[2] = {NULL, NULL};
    PyObject *result = NULL;
    Py_ssize_t n = -1, holder;
    const double *setup = NULL, *per_byte = NULL;
    int rc = vec_open(args[1], &hv, 'd', -1, &n);
    if (rc == 0) {
        rc = vec_open(args[2], &fv, '?', n, NULL);
    }
    if (rc == 0 && slot_arg(args[0], n, &holder) < 0) {
        rc = -1;
    }
    if (rc == 0) {
        rc = row_open(args[3], &sv, n, holder, &setup);
    }
    if (rc == 0) {
        rc = row_open(args[4], &pv, n, holder, &per_byte);
    }
    if (rc == UNSUPPORTED) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (rc < 0) {
        goto done;
    }
    if ((res[0] = vec_new(n, 'd', &out[0])) == NULL ||
        (res[1] = vec_new(n, 'd', &out[1])) == NULL) {
        goto done;
    }
    const double *hits = dvec(&hv);
    const char *fetch = bvec(&fv);
    double *cached = dvec(&out[0]), *transfer = dvec(&out[1]);
    double held = hits[holder];
    for (Py_ssize_t j = 0; j < n; j++) {
        double t = transfer_one(held - hits[j], kv, setup[j], per_byte[j]);
        transfer[j] = fetch[j] ? t : 0.0;
        cached[j] = fetch[j] ? held : hits[j];
    }
    result = tuple_steal(2, res);
    res[0] = res[1] = NULL;
done:
    vec_close(&hv);
    vec_close(&fv);
    vec_close(&sv);
    vec_close(&pv);
    for (int i = 0; i < 2; i++) {
        vec_close(&out[i]);
        Py_XDECREF(res[i]);
    }
    return result;
}

/* ---- migration candidates --------------------------------------------------------------------- */

/* candidates(eligible, free_blocks, block_size, context_tokens, pending, host) -> bool vector:
 * MigrationPlanner.candidates (eligible slots other than the host with room for the context
 * and fewer pending prefill tokens than the host). */
static PyObject *candidates(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("candidates", 6)
    double bs = PyFloat_AsDouble(args[2]);
    if (bs == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    double context = PyFloat_AsDouble(args[3]);
    if (context == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Vec ev = {0}, fv = {0}, pv = {0}, out = {0};
    PyObject *res = NULL;
    PyObject *result = NULL;
    Py_ssize_t n = -1, host;
    int rc = vec_open(args[0], &ev, '?', -1, &n);
    if (rc == 0) {
        rc = vec_open(args[1], &fv, 'd', n, NULL);
    }
    if (rc == 0) {
        rc = vec_open(args[4], &pv, 'd', n, NULL);
    }
    if (rc == 0 && slot_arg(args[5], n, &host) < 0) {
        rc = -1;
    }
    if (rc == UNSUPPORTED) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (rc < 0 || (res = vec_new(n, '?', &out)) == NULL) {
        goto done;
    }
    const char *eligible = bvec(&ev);
    const double *free_blocks = dvec(&fv), *pending = dvec(&pv);
    char *mask = (char *)out.buf.buf;
    double limit = pending[host];
    for (Py_ssize_t j = 0; j < n; j++) {
        mask[j] = (char)(eligible[j] && free_blocks[j] * bs >= context && pending[j] < limit);
    }
    mask[host] = 0;
    result = res;
    res = NULL;
done:
    vec_close(&ev);
    vec_close(&fv);
    vec_close(&pv);
    vec_close(&out);
    Py_XDECREF(res);
    return result;
}

/* ---- a cold start's score (elastic) ------------------------------------------------------------ */

/* cold_score(ttft, prefill, pending_s, eligible, resident, context_tokens, capacity_tokens)
 *   -> (score, pool): elastic's cold-start score, TTFT plus the extra prefill over the
 * cheapest eligible slot's weighted by the share of eligible slots with queued prefill, and
 * the slots to pick from (the eligible ones whose resident sessions leave room for the
 * context, or `eligible` itself when none does). NotImplemented when no slot is eligible. */
static PyObject *cold_score(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("cold_score", 7)
    double context = PyFloat_AsDouble(args[5]);
    if (context == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    double capacity = PyFloat_AsDouble(args[6]);
    if (capacity == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Vec tv = {0}, pv = {0}, qv = {0}, ev = {0}, rv = {0}, out[2] = {0};
    PyObject *res[2] = {NULL, NULL};
    PyObject *result = NULL;
    Py_ssize_t n = -1;
    int rc = vec_open(args[0], &tv, 'd', -1, &n);
    if (rc == 0) {
        rc = vec_open(args[1], &pv, 'd', n, NULL);
    }
    if (rc == 0) {
        rc = vec_open(args[2], &qv, 'd', n, NULL);
    }
    if (rc == 0) {
        rc = vec_open(args[3], &ev, '?', n, NULL);
    }
    if (rc == 0) {
        rc = vec_open(args[4], &rv, 'd', n, NULL);
    }
    if (rc == UNSUPPORTED) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (rc < 0) {
        goto done;
    }
    const double *ttft = dvec(&tv), *prefill = dvec(&pv), *pending = dvec(&qv);
    const double *resident = dvec(&rv);
    const char *eligible = bvec(&ev);
    Py_ssize_t count = 0, busy = 0;
    double floor = 0.0;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (!eligible[j]) {
            continue;
        }
        busy += pending[j] > 0;
        /* masked_min: NaN propagates, else the smallest. */
        if (count == 0 || (isnan(prefill[j]) && !isnan(floor)) || prefill[j] < floor) {
            floor = prefill[j];
        }
        count++;
    }
    if (count == 0) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    /* np.mean of the busy flags: their count (exact) over the eligible slots'. */
    double share = (double)busy / (double)count;
    if ((res[0] = vec_new(n, 'd', &out[0])) == NULL ||
        (res[1] = vec_new(n, '?', &out[1])) == NULL) {
        goto done;
    }
    double *score = dvec(&out[0]);
    char *fits = (char *)out[1].buf.buf;
    int any = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        double extra = prefill[j] - floor;
        score[j] = ttft[j] + share * extra;
        fits[j] = (char)(eligible[j] && resident[j] + context <= capacity);
        any |= fits[j];
    }
    if (!any) {
        Py_SETREF(res[1], Py_NewRef(args[3]));
    }
    result = tuple_steal(2, res);
    res[0] = res[1] = NULL;
done:
    vec_close(&tv);
    vec_close(&pv);
    vec_close(&qv);
    vec_close(&ev);
    vec_close(&rv);
    for (int i = 0; i < 2; i++) {
        vec_close(&out[i]);
        Py_XDECREF(res[i]);
    }
    return result;
}

/* best_slot(hit_blocks, eligible) -> int: RequestView.best_slot, the eligible slot with the
 * longest hit (the first on ties; numpy's argmax, a NaN first of all), or -1 when its hit is
 * not positive. */
static PyObject *best_slot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("best_slot", 2)
    Vec hv = {0}, ev = {0};
    Py_ssize_t n = -1;
    PyObject *result = NULL;
    int rc = vec_open(args[0], &hv, 'd', -1, &n);
    if (rc == 0) {
        rc = vec_open(args[1], &ev, '?', n, NULL);
    }
    if (rc == UNSUPPORTED || (rc == 0 && n == 0)) {
        /* An empty vector: numpy's argmax raises, and so does the reference. */
        result = Py_NewRef(Py_NotImplemented);
    } else if (rc == 0) {
        const double *hits = dvec(&hv);
        const char *eligible = bvec(&ev);
        Py_ssize_t best = 0;
        double bv = eligible[0] ? hits[0] : -1.0;
        for (Py_ssize_t j = 1; j < n && !isnan(bv); j++) {
            double x = eligible[j] ? hits[j] : -1.0;
            if (isnan(x) || x > bv) {
                best = j;
                bv = x;
            }
        }
        result = PyLong_FromSsize_t(bv > 0 ? best : -1);
    }
    vec_close(&hv);
    vec_close(&ev);
    return result;
}

/* ---- picking --------------------------------------------------------------------------------- */

/* masked_min(values, mask) -> float: np.min(values[mask]); ValueError when the mask is empty. */
static PyObject *masked_min(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("masked_min", 2)
    Vec vv = {0}, mv = {0};
    Py_ssize_t n = -1;
    int rc = vec_open(args[0], &vv, 'd', -1, &n);
    if (rc == 0) {
        rc = vec_open(args[1], &mv, '?', n, NULL);
    }
    PyObject *result = NULL;
    if (rc == UNSUPPORTED) {
        result = Py_NewRef(Py_NotImplemented);
    } else if (rc == 0) {
        const double *v = dvec(&vv);
        const char *m = bvec(&mv);
        int any = 0;
        double best = 0.0;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (!m[j]) {
                continue;
            }
            if (!any) {
                best = v[j];
                any = 1;
            } else if (isnan(v[j]) && !isnan(best)) {
                best = v[j];
            } else if (v[j] < best) {
                best = v[j];
            }
        }
        if (any) {
            result = PyFloat_FromDouble(best);
        } else {
            PyErr_SetString(PyExc_ValueError,
                            "zero-size array to reduction operation minimum which has no identity");
        }
    }
    vec_close(&vv);
    vec_close(&mv);
    return result;
}

/* numpy's sort order for doubles: NaN after everything. */
static inline int sort_lt(double a, double b) { return a < b || (isnan(b) && !isnan(a)); }

/* argmin(values, eligible, tiebreaks) -> int: pickers.argmin_eligible. */
static PyObject *argmin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("argmin", 3)
    if (!PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "tiebreaks: a tuple of vectors");
        return NULL;
    }
    Py_ssize_t keys = PyTuple_GET_SIZE(args[2]);
    if (keys > 8) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    Vec vv = {0}, mv = {0}, tv[8] = {{{0}}};
    Py_ssize_t n = -1;
    PyObject *result = NULL;
    int rc = vec_open(args[0], &vv, 'd', -1, &n);
    if (rc == 0) {
        rc = vec_open(args[1], &mv, '?', n, NULL);
    }
    for (Py_ssize_t k = 0; rc == 0 && k < keys; k++) {
        rc = vec_open(PyTuple_GET_ITEM(args[2], k), &tv[k], 'd', n, NULL);
    }
    if (rc == UNSUPPORTED) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (rc < 0) {
        goto done;
    }
    const double *v = dvec(&vv);
    const char *m = bvec(&mv);
    /* np.argmin over np.where(eligible, values, inf): the first NaN, else the first minimum. */
    Py_ssize_t best = -1;
    int any = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        double x = m[j] ? v[j] : INFINITY;
        any |= m[j] != 0;
        if (best < 0) {
            best = j;
        } else {
            double b = m[best] ? v[best] : INFINITY;
            if (isnan(b)) {
                continue;
            }
            if (isnan(x) || x < b) {
                best = j;
            }
        }
    }
    if (!any) {
        PyErr_SetString(PyExc_ValueError, "no eligible instance");
        goto done;
    }
    double bv = m[best] ? v[best] : INFINITY;
    if (keys > 0) {
        Py_ssize_t equal = 0;
        for (Py_ssize_t j = 0; j < n; j++) {
            equal += (m[j] ? v[j] : INFINITY) == bv;
        }
        if (equal != 1) {
            /* np.lexsort with the values first, then each tiebreak in turn, then the slot:
             * the smallest in numpy's sort order (NaN last), ineligible slots at inf. */
            Py_ssize_t win = 0;
            for (Py_ssize_t j = 1; j < n; j++) {
                int lt = 0;
                double a = m[j] ? v[j] : INFINITY, b = m[win] ? v[win] : INFINITY;
                if (sort_lt(a, b)) {
                    lt = 1;
                } else if (!sort_lt(b, a)) {
                    for (Py_ssize_t k = 0; k < keys; k++) {
                        const double *t = dvec(&tv[k]);
                        a = m[j] ? t[j] : INFINITY;
                        b = m[win] ? t[win] : INFINITY;
                        if (sort_lt(a, b)) {
                            lt = 1;
                            break;
                        }
                        if (sort_lt(b, a)) {
                            break;
                        }
                    }
                }
                if (lt) {
                    win = j;
                }
            }
            best = win;
        }
    }
    result = PyLong_FromSsize_t(best);
done:
    vec_close(&vv);
    vec_close(&mv);
    for (Py_ssize_t k = 0; k < keys; k++) {
        vec_close(&tv[k]);
    }
    return result;
}

/* ---- hits ------------------------------------------------------------------------------------ */

/* np.minimum(t, cap) for doubles: NaN propagates, else the smaller (the first on ties). */
static inline double np_min(double a, double b) {
    if (isnan(a)) {
        return a;
    }
    if (isnan(b)) {
        return b;
    }
    return a <= b ? a : b;
}

/* hit_vectors(n, matches, block_size, cap_tokens) -> (blocks, tokens, pool_tokens|None): per
 * slot the most leading blocks any of the `matches` ({slot: blocks} dicts) gives it, those
 * blocks in tokens capped at `cap_tokens`, and the tokens of them beyond the last match's (the
 * GPU tier's, capped alike), None when no slot has any (request_view.hit_vectors). The third
 * vector is only made when an earlier match holds something: a GPU-only index allocates none. */
static int add_match(PyObject *match, Py_ssize_t n, double *blocks, double *last) {
    if (!PyDict_Check(match)) {
        PyErr_SetString(PyExc_TypeError, "matches: a tuple of dicts");
        return -1;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(match, &pos, &key, &value)) {
        Py_ssize_t slot = PyLong_AsSsize_t(key);
        if (slot == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (slot < 0 || slot >= n) {
            PyErr_Format(PyExc_IndexError, "slot %zd of %zd", slot, n);
            return -1;
        }
        double count = PyFloat_AsDouble(value);
        if (count == -1.0 && PyErr_Occurred()) {
            return -1;
        }
        if (last != NULL) {
            last[slot] = count;
        }
        blocks[slot] = np_max(blocks[slot], count);
    }
    return 0;
}

static PyObject *hit_vectors(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("hit_vectors", 4)
    Py_ssize_t n = PyLong_AsSsize_t(args[0]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative number of slots");
        return NULL;
    }
    if (!PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "matches: a tuple of dicts");
        return NULL;
    }
    double bs = PyFloat_AsDouble(args[2]);
    if (bs == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    double cap = PyFloat_AsDouble(args[3]);
    if (cap == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Vec out[3] = {0};
    PyObject *res[3] = {NULL, NULL, NULL};
    PyObject *result = NULL;
    if ((res[0] = vec_new(n, 'd', &out[0])) == NULL ||
        (res[1] = vec_new(n, 'd', &out[1])) == NULL) {
        goto done;
    }
    double *blocks = dvec(&out[0]), *tokens = dvec(&out[1]), *pool = NULL;
    memset(blocks, 0, (size_t)n * sizeof(double));
    Py_ssize_t n_matches = PyTuple_GET_SIZE(args[1]);
    int earlier = 0; /* whether a match before the last holds anything */
    for (Py_ssize_t i = 0; i < n_matches; i++) {
        PyObject *match = PyTuple_GET_ITEM(args[1], i);
        if (i == n_matches - 1 && earlier) {
            /* The last match's blocks go to `pool` (its tokens are taken off at the end). */
            if ((res[2] = vec_new(n, 'd', &out[2])) == NULL) {
                goto done;
            }
            pool = dvec(&out[2]);
            memset(pool, 0, (size_t)n * sizeof(double));
        }
        if (add_match(match, n, blocks, pool) < 0) {
            goto done;
        }
        if (i < n_matches - 1 && PyDict_GET_SIZE(match) > 0) {
            earlier = 1;
        }
    }
    int any = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        tokens[j] = np_min(blocks[j] * bs, cap);
        if (pool != NULL) {
            pool[j] = tokens[j] - np_min(pool[j] * bs, cap);
            any |= pool[j] != 0.0;
        }
    }
    if (!any) {
        vec_close(&out[2]);
        Py_CLEAR(res[2]);
        res[2] = Py_NewRef(Py_None);
    }
    result = tuple_steal(3, res);
    res[0] = res[1] = res[2] = NULL;
done:
    for (int i = 0; i < 3; i++) {
        vec_close(&out[i]);
        Py_XDECREF(res[i]);
    }
    return result;
}

/* ---- loading from the node's pool ------------------------------------------------------------ */

/* pool_load(pool_tokens, prefill, (setup, per_byte, kv_bytes_per_token, layers))
 *   -> (load, wait): cost.pool_load. */
static PyObject *pool_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    CHECK_ARGS("pool_load", 3)
    PyObject *consts = args[2];
    if (!PyTuple_Check(consts) || PyTuple_GET_SIZE(consts) != 4) {
        PyErr_SetString(PyExc_TypeError, "constants: a tuple of 4 numbers");
        return NULL;
    }
    double k[4];
    for (int i = 0; i < 4; i++) {
        k[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(consts, i));
        if (k[i] == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
    }
    double setup = k[0], per_byte = k[1], kv = k[2], layers = k[3];
    Vec in[2] = {0}, out[2] = {0};
    PyObject *res[2] = {NULL, NULL};
    PyObject *result = NULL;
    Py_ssize_t n = -1;
    int rc = vec_open(args[0], &in[0], 'd', -1, &n);
    if (rc == 0) {
        rc = vec_open(args[1], &in[1], 'd', n, NULL);
    }
    if (rc == UNSUPPORTED) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (rc < 0) {
        goto done;
    }
    if ((res[0] = vec_new(n, 'd', &out[0])) == NULL ||
        (res[1] = vec_new(n, 'd', &out[1])) == NULL) {
        goto done;
    }
    const double *tokens = dvec(&in[0]), *prefill = dvec(&in[1]);
    double *load = dvec(&out[0]), *wait = dvec(&out[1]);
    for (Py_ssize_t j = 0; j < n; j++) {
        /* cost.pool_load, operation by operation as numpy evaluates it. */
        int loading = tokens[j] > 0;
        double moving = setup + (tokens[j] * kv) * per_byte;
        double l = loading ? moving : 0.0;
        double hidden = np_min(l, prefill[j]) / layers;
        double exposed = np_clip_low0(l - prefill[j]) + hidden;
        load[j] = l;
        wait[j] = loading ? exposed : 0.0;
    }
    result = tuple_steal(2, res);
    res[0] = res[1] = NULL;
done:
    for (int i = 0; i < 2; i++) {
        vec_close(&in[i]);
        vec_close(&out[i]);
        Py_XDECREF(res[i]);
    }
    return result;
}

/* ---- module ---------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"ttft", (PyCFunction)(void (*)(void))ttft, METH_FASTCALL,
     "ttft(prompt_tokens, cached, running, decode_tokens, queue, transfer, constants) -> "
     "(prefill, transfer, ttft)"},
    {"moving", (PyCFunction)(void (*)(void))moving, METH_FASTCALL,
     "moving(host, hits, setup, per_byte, kv_bytes_per_token) -> (cached, transfer)"},
    {"fetch_when_cheaper", (PyCFunction)(void (*)(void))fetch_when_cheaper, METH_FASTCALL,
     "fetch_when_cheaper(holder, prompt_tokens, hits, eligible, setup, per_byte, constants, "
     "holder_prefill_s) -> (fetch, cached, transfer)"},
    {"fetch_from", (PyCFunction)(void (*)(void))fetch_from, METH_FASTCALL,
     "fetch_from(holder, hits, fetch, setup, per_byte, kv_bytes_per_token) -> (cached, "
     "transfer)"},
    {"candidates", (PyCFunction)(void (*)(void))candidates, METH_FASTCALL,
     "candidates(eligible, free_blocks, block_size, context_tokens, pending, host) -> mask"},
    {"cold_score", (PyCFunction)(void (*)(void))cold_score, METH_FASTCALL,
     "cold_score(ttft, prefill, pending_s, eligible, resident, context_tokens, "
     "capacity_tokens) -> (score, pool)"},
    {"best_slot", (PyCFunction)(void (*)(void))best_slot, METH_FASTCALL,
     "best_slot(hit_blocks, eligible) -> int"},
    {"masked_min", (PyCFunction)(void (*)(void))masked_min, METH_FASTCALL,
     "masked_min(values, mask) -> float"},
    {"argmin", (PyCFunction)(void (*)(void))argmin, METH_FASTCALL,
     "argmin(values, eligible, tiebreaks) -> int"},
    {"hit_vectors", (PyCFunction)(void (*)(void))hit_vectors, METH_FASTCALL,
     "hit_vectors(n, matches, block_size, cap_tokens) -> (blocks, tokens, pool_tokens|None)"},
    {"pool_load", (PyCFunction)(void (*)(void))pool_load, METH_FASTCALL,
     "pool_load(pool_tokens, prefill, (setup, per_byte, kv_bytes_per_token, layers)) -> "
     "(load, wait)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvsched.core._scoring",
    "Compiled per-instance scoring (see kvsched.core.scoring).", -1, methods,
};

PyMODINIT_FUNC PyInit__scoring(void) {
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (numpy == NULL) {
        return NULL;
    }
    np_empty = PyObject_GetAttrString(numpy, "empty");
    np_bool = PyObject_GetAttrString(numpy, "bool_");
    Py_DECREF(numpy);
    dtype_kwnames = Py_BuildValue("(s)", "dtype");
    if (np_empty == NULL || np_bool == NULL || dtype_kwnames == NULL) {
        return NULL;
    }
    return PyModule_Create(&module);
}
