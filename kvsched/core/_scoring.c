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
 * reference instead. Each kernel opens its arguments through `kernel_open` from a layout that
 * names their kinds, and states only its own loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

static PyObject *np_empty;      /* numpy.empty */
static PyObject *np_bool;       /* numpy.bool_ */
static PyObject *dtype_kwnames; /* ("dtype",) */

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
    double kv_bytes_per_token, prefill_ctx_s;
} Constants;

/* The node pool's host link constants a pool load reads (`CostModel.pool_constants`). */
typedef struct {
    double setup_s, per_byte, kv_bytes_per_token, layers;
} PoolConstants;

/* Reads `obj`, a tuple of `count` numbers, into *out[0], ..., *out[count - 1]. */
static int read_numbers(PyObject *obj, Py_ssize_t count, double *const *out) {
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != count) {
        PyErr_Format(PyExc_TypeError, "constants: a tuple of %zd numbers", count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        double v = PyFloat_AsDouble(PyTuple_GET_ITEM(obj, i));
        if (v == -1.0 && PyErr_Occurred()) {
            return -1;
        }
        *out[i] = v;
    }
    return 0;
}

static int read_constants(PyObject *obj, Constants *c) {
    double *const out[8] = {&c->step_s,          &c->decode_seq_s, &c->decode_ctx_s,
                            &c->prefill_token_s, &c->attn_pair_s,  &c->chunk,
                            &c->kv_bytes_per_token, &c->prefill_ctx_s};
    return read_numbers(obj, 8, out);
}

static int read_pool_constants(PyObject *obj, PoolConstants *p) {
    double *const out[4] = {&p->setup_s, &p->per_byte, &p->kv_bytes_per_token, &p->layers};
    return read_numbers(obj, 4, out);
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

/* ---- a kernel's arguments and outputs --------------------------------------------------------- */

enum { MAX_ARGS = 8, MAX_TIEBREAKS = 8, MAX_BUFFERS = 2 + MAX_TIEBREAKS, MAX_OUTPUTS = 3 };

/* One kernel call: what it read and what it made. `kernel_open` reads the arguments as the
 * kernel's Layout says, a letter an argument:
 *
 *   'f'  a number                                                   -> num[i]
 *   'c'  the step-time constants                                    -> c
 *   'p'  the node pool's host link constants                        -> pool
 *   'd'  a float64 vector, '?' a bool vector, 'D' a float64 vector or None (NULL): the first
 *        vector's length is the slot count n, every other must have n slots  -> vec[i]
 *   's'  a slot of those n                                          -> slot
 *   'r'  an n x n float64 transfer matrix, read at the slot's row   -> vec[i]
 *   '-'  read by the kernel itself
 *
 * The kinds are read in that order, each in argument order, so a call with several bad
 * arguments fails on the one it always has. Buffers stay open and outputs held until
 * `kernel_done`, which every kernel returns through. */
typedef struct {
    Py_ssize_t n, slot;
    double num[MAX_ARGS];
    const void *vec[MAX_ARGS];
    Constants c;
    PoolConstants pool;
    int unsupported; /* an argument is not of its kind: the answer is NotImplemented */
    int n_held, n_out;
    Py_buffer held[MAX_BUFFERS + MAX_OUTPUTS];
    PyObject *out[MAX_OUTPUTS];
    void *made[MAX_OUTPUTS]; /* the outputs' data, where this kernel made them */
} Kernel;

/* (buffer_open, kernel_open and kernel_done are inline: every kernel call runs them, and as
 * calls they cost up to a tenth of a small kernel's instructions.) */

/* Opens `obj` as a C-contiguous buffer of `kind` ('d' float64, '?' bool): 1-D of n slots (any
 * length while n is unknown, which then sets it) or 2-D of n x n. Returns 0 with its data in
 * *data, or -1: unsupported (no error set) when it is not such a buffer, ValueError when a
 * vector has another length. */
static inline int buffer_open(Kernel *k, PyObject *obj, char kind, int ndim, const void **data) {
    if (k->n_held == MAX_BUFFERS + MAX_OUTPUTS) {
        PyErr_SetString(PyExc_RuntimeError, "a scoring kernel opened too many vectors");
        return -1;
    }
    Py_buffer *b = &k->held[k->n_held];
    /* Inputs are only read; outputs are arrays this module just made, so writing them is
     * safe without asking for a writable buffer. */
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        k->unsupported = 1;
        return -1;
    }
    const char *fmt = b->format;
    int fits = b->ndim == ndim && b->itemsize == (kind == 'd' ? 8 : 1) && fmt != NULL &&
               fmt[0] == kind && fmt[1] == '\0';
    if (fits && ndim == 2) {
        fits = b->shape[0] == k->n && b->shape[1] == k->n;
    }
    if (!fits) {
        PyBuffer_Release(b);
        k->unsupported = 1;
        return -1;
    }
    if (ndim == 1 && k->n < 0) {
        k->n = b->shape[0];
    } else if (ndim == 1 && b->shape[0] != k->n) {
        PyErr_Format(PyExc_ValueError, "vectors of %zd and %zd slots", k->n, b->shape[0]);
        PyBuffer_Release(b);
        return -1;
    }
    k->n_held++;
    *data = b->buf;
    return 0;
}

/* A kernel's arguments: its name, their kinds (a letter an argument, see Kernel) and, worked
 * out on its first call, the order they are read in. */
typedef struct {
    const char *name, *kinds;
    Py_ssize_t nargs;           /* 0 until the first call */
    int n_read;                 /* the arguments not marked '-' */
    signed char read[MAX_ARGS]; /* their positions, in reading order */
} Layout;

/* Fills in `l`'s count and reading order from its letters: 'f', 'c' and 'p', the vectors, 's',
 * 'r'. */
static void layout_ready(Layout *l) {
    static const char *const passes[] = {"f", "cp", "d?D", "s", "r"};
    Py_ssize_t nargs = (Py_ssize_t)strlen(l->kinds);
    l->n_read = 0;
    for (int pass = 0; pass < 5; pass++) {
        for (Py_ssize_t i = 0; i < nargs && i < MAX_ARGS; i++) {
            if (strchr(passes[pass], l->kinds[i]) != NULL) {
                l->read[l->n_read++] = (signed char)i;
            }
        }
    }
    l->nargs = nargs;
}

/* Starts `k` and reads `args` as `l` says (see Kernel). 0, or -1: an error set, or
 * k->unsupported. */
static inline int kernel_open(Kernel *k, Layout *l, PyObject *const *args, Py_ssize_t nargs) {
    k->n = -1;
    k->unsupported = k->n_held = k->n_out = 0;
    if (l->nargs == 0) {
        layout_ready(l);
    }
    if (nargs != l->nargs) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", l->name, l->nargs,
                     nargs);
        return -1;
    }
    for (int r = 0; r < l->n_read; r++) {
        int i = l->read[r], rc = 0;
        switch (l->kinds[i]) {
        case 'f':
            k->num[i] = PyFloat_AsDouble(args[i]);
            rc = k->num[i] == -1.0 && PyErr_Occurred() ? -1 : 0;
            break;
        case 'c':
            rc = read_constants(args[i], &k->c);
            break;
        case 'p':
            rc = read_pool_constants(args[i], &k->pool);
            break;
        case 'd':
        case 'D':
            if (l->kinds[i] == 'D' && args[i] == Py_None) {
                k->vec[i] = NULL;
            } else {
                rc = buffer_open(k, args[i], 'd', 1, &k->vec[i]);
            }
            break;
        case '?':
            rc = buffer_open(k, args[i], '?', 1, &k->vec[i]);
            break;
        case 's':
            rc = slot_arg(args[i], k->n, &k->slot);
            break;
        case 'r':
            rc = buffer_open(k, args[i], 'd', 2, &k->vec[i]);
            if (rc == 0) {
                k->vec[i] = (const double *)k->vec[i] + k->slot * k->n;
            }
            break;
        }
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* Makes the next outputs, a letter each ('d' float64, '?' bool), as fresh numpy vectors of n
 * slots with their data in made[]. 0, or -1 with an error set. */
static int kernel_outputs(Kernel *k, const char *kinds) {
    for (const char *kind = kinds; *kind != '\0'; kind++) {
        PyObject *size = PyLong_FromSsize_t(k->n);
        if (size == NULL) {
            return -1;
        }
        PyObject *arr;
        if (*kind == 'd') {
            arr = PyObject_CallOneArg(np_empty, size);
        } else {
            PyObject *args[2] = {size, np_bool};
            arr = PyObject_Vectorcall(np_empty, args, 1, dtype_kwnames);
        }
        Py_DECREF(size);
        if (arr == NULL) {
            return -1;
        }
        k->out[k->n_out] = arr;
        const void *data;
        if (buffer_open(k, arr, *kind, 1, &data) < 0) {
            Py_DECREF(arr);
            if (k->unsupported) {
                k->unsupported = 0;
                PyErr_SetString(PyExc_RuntimeError, "numpy.empty made no C-contiguous vector");
            }
            return -1;
        }
        k->made[k->n_out++] = (void *)data;
    }
    return 0;
}

/* The outputs, in the order made: the one itself, or a tuple of them. */
static PyObject *kernel_result(Kernel *k) {
    if (k->n_out == 1) {
        return Py_NewRef(k->out[0]);
    }
    PyObject *t = PyTuple_New(k->n_out);
    if (t == NULL) {
        return NULL;
    }
    for (int i = 0; i < k->n_out; i++) {
        PyTuple_SET_ITEM(t, i, Py_NewRef(k->out[i]));
    }
    return t;
}

/* Releases what the call opened and made, and returns `result`, or NotImplemented when an
 * argument was not of its kind. */
static inline PyObject *kernel_done(Kernel *k, PyObject *result) {
    for (int i = 0; i < k->n_held; i++) {
        PyBuffer_Release(&k->held[i]);
    }
    for (int i = 0; i < k->n_out; i++) {
        Py_DECREF(k->out[i]);
    }
    if (result == NULL && k->unsupported) {
        return Py_NewRef(Py_NotImplemented);
    }
    return result;
}

/* CostModel.transfer_from for one slot: seconds to move `tokens` from the row's source. */
static inline double transfer_one(double tokens, double kv, double setup, double per_byte) {
    double nbytes = tokens * kv;
    double moving = setup + nbytes * per_byte;
    return tokens > 0 ? moving : 0.0;
}

/* latency.context_read(passes, n_cached, chunk): the context a prompt's chunks read. */
static inline double context_read(double passes, double n_cached, double chunk) {
    return passes * n_cached + chunk * passes * (passes - 1.0) * 0.5;
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
    double read = c->prefill_ctx_s * context_read(passes, n_cached, c->chunk);
    return ((a + b) + attn * pairs) + read;
}

/* ---- ttft ---------------------------------------------------------------------------------- */

/* ttft(prompt_tokens, cached, running, decode_tokens, queue, transfer|None, constants)
 *   -> (prefill, transfer, ttft). `transfer` is returned as given, or a new zero vector. */
static Layout ttft_args = {"ttft", "fddddDc"};

static PyObject *ttft(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &ttft_args, args, nargs) < 0 || kernel_outputs(&k, "d") < 0) {
        return kernel_done(&k, NULL);
    }
    const double *transfer = k.vec[5];
    if (transfer != NULL) {
        k.out[k.n_out++] = Py_NewRef(args[5]);
    } else if (kernel_outputs(&k, "d") < 0) {
        return kernel_done(&k, NULL);
    } else {
        /* adding its zeros is adding the reference's 0.0 */
        transfer = memset(k.made[1], 0, (size_t)k.n * sizeof(double));
    }
    if (kernel_outputs(&k, "d") < 0) {
        return kernel_done(&k, NULL);
    }
    const double *cached = k.vec[1], *running = k.vec[2], *decode = k.vec[3], *queue = k.vec[4];
    double prompt = k.num[0], *prefill = k.made[0], *est = k.made[2];
    const Constants c = k.c;
    for (Py_ssize_t j = 0; j < k.n; j++) {
        /* cost.ttft_terms, operation by operation as numpy evaluates it. */
        double n_new = prompt - cached[j];
        double per_pass = (c.step_s + c.decode_seq_s * running[j]) + c.decode_ctx_s * decode[j];
        double passes = np_max(ceil(n_new / c.chunk), 1.0);
        double pairs = cached[j] + n_new * 0.5;
        double per_token = c.prefill_token_s + c.attn_pair_s * pairs;
        double read = c.prefill_ctx_s * context_read(passes, cached[j], c.chunk);
        prefill[j] = (passes * per_pass + n_new * per_token) + read;
        est[j] = (queue[j] + prefill[j]) + transfer[j];
    }
    return kernel_done(&k, kernel_result(&k));
}

/* ---- moving a host's prefix ------------------------------------------------------------------ */

/* moving(host, hits, setup, per_byte, kv_bytes_per_token) -> (cached, transfer): every slot
 * after the host's part of the prompt moved there (cost.moving_terms before its TTFT). */
static Layout moving_args = {"moving", "sdrrf"};

static PyObject *moving(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &moving_args, args, nargs) < 0 || kernel_outputs(&k, "dd") < 0) {
        return kernel_done(&k, NULL);
    }
    const double *hits = k.vec[1], *setup = k.vec[2], *per_byte = k.vec[3];
    double *cached = k.made[0], *transfer = k.made[1];
    double held = hits[k.slot], kv = k.num[4];
    for (Py_ssize_t j = 0; j < k.n; j++) {
        double moved = np_clip_low0(held - hits[j]);
        cached[j] = np_max(hits[j], held);
        transfer[j] = transfer_one(moved, kv, setup[j], per_byte[j]);
    }
    return kernel_done(&k, kernel_result(&k));
}

/* ---- fetching a prefix from its holder ------------------------------------------------------- */

/* fetch_when_cheaper(holder, prompt_tokens, hits, eligible, setup, per_byte, constants,
 *   holder_prefill_s) -> (fetch, cached, transfer): cost.fetch_when_cheaper. */
static Layout fetch_when_cheaper_args = {"fetch_when_cheaper", "sfd?rrcf"};

static PyObject *fetch_when_cheaper(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &fetch_when_cheaper_args, args, nargs) < 0 ||
        kernel_outputs(&k, "?dd") < 0) {
        return kernel_done(&k, NULL);
    }
    const double *hits = k.vec[2], *setup = k.vec[4], *per_byte = k.vec[5];
    const char *eligible = k.vec[3];
    char *fetch = k.made[0];
    double *cached = k.made[1], *transfer = k.made[2];
    double prompt = k.num[1], own = k.num[7], held = hits[k.slot];
    for (Py_ssize_t j = 0; j < k.n; j++) {
        double extra = np_clip_low0(held - hits[j]);
        double fetch_s = transfer_one(extra, k.c.kv_bytes_per_token, setup[j], per_byte[j]);
        double saved = prefill_one(&k.c, prompt - hits[j], hits[j]) - own;
        int f = eligible[j] && extra > 0 && fetch_s < saved;
        fetch[j] = (char)f;
        cached[j] = f ? held : hits[j];
        transfer[j] = f ? fetch_s : 0.0;
    }
    return kernel_done(&k, kernel_result(&k));
}

/* fetch_from(holder, hits, fetch, setup, per_byte, kv_bytes_per_token) -> (cached, transfer):
 * cost.fetch_from. */
static Layout fetch_from_args = {"fetch_from", "sd?rrf"};

static PyObject *fetch_from(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &fetch_from_args, args, nargs) < 0 ||
        kernel_outputs(&k, "dd") < 0) {
        return kernel_done(&k, NULL);
    }
    const double *hits = k.vec[1], *setup = k.vec[3], *per_byte = k.vec[4];
    const char *fetch = k.vec[2];
    double *cached = k.made[0], *transfer = k.made[1];
    double held = hits[k.slot], kv = k.num[5];
    for (Py_ssize_t j = 0; j < k.n; j++) {
        double t = transfer_one(held - hits[j], kv, setup[j], per_byte[j]);
        transfer[j] = fetch[j] ? t : 0.0;
        cached[j] = fetch[j] ? held : hits[j];
    }
    return kernel_done(&k, kernel_result(&k));
}

/* ---- migration candidates --------------------------------------------------------------------- */

/* candidates(eligible, free_blocks, block_size, context_tokens, pending, host) -> bool vector:
 * MigrationPlanner.candidates (eligible slots other than the host with room for the context
 * and fewer pending prefill tokens than the host). */
static Layout candidates_args = {"candidates", "?dffds"};

static PyObject *candidates(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &candidates_args, args, nargs) < 0 ||
        kernel_outputs(&k, "?") < 0) {
        return kernel_done(&k, NULL);
    }
    const char *eligible = k.vec[0];
    const double *free_blocks = k.vec[1], *pending = k.vec[4];
    char *mask = k.made[0];
    double bs = k.num[2], context = k.num[3], limit = pending[k.slot];
    for (Py_ssize_t j = 0; j < k.n; j++) {
        mask[j] = (char)(eligible[j] && free_blocks[j] * bs >= context && pending[j] < limit);
    }
    mask[k.slot] = 0;
    return kernel_done(&k, kernel_result(&k));
}

/* ---- a cold start's score (elastic) ------------------------------------------------------------ */

/* cold_score(ttft, prefill, pending_s, eligible, resident, context_tokens, capacity_tokens)
 *   -> (score, pool): elastic's cold-start score, TTFT plus the extra prefill over the
 * cheapest eligible slot's weighted by the share of eligible slots with queued prefill, and
 * the slots to pick from (the eligible ones whose resident sessions leave room for the
 * context, or `eligible` itself when none does). NotImplemented when no slot is eligible. */
static Layout cold_score_args = {"cold_score", "ddd?dff"};

static PyObject *cold_score(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &cold_score_args, args, nargs) < 0) {
        return kernel_done(&k, NULL);
    }
    const double *ttft = k.vec[0], *prefill = k.vec[1], *pending = k.vec[2];
    const double *resident = k.vec[4];
    const char *eligible = k.vec[3];
    double context = k.num[5], capacity = k.num[6];
    Py_ssize_t count = 0, busy = 0;
    double floor = 0.0;
    for (Py_ssize_t j = 0; j < k.n; j++) {
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
        return kernel_done(&k, Py_NewRef(Py_NotImplemented));
    }
    /* np.mean of the busy flags: their count (exact) over the eligible slots'. */
    double share = (double)busy / (double)count;
    if (kernel_outputs(&k, "d?") < 0) {
        return kernel_done(&k, NULL);
    }
    double *score = k.made[0];
    char *fits = k.made[1];
    int any = 0;
    for (Py_ssize_t j = 0; j < k.n; j++) {
        double extra = prefill[j] - floor;
        score[j] = ttft[j] + share * extra;
        fits[j] = (char)(eligible[j] && resident[j] + context <= capacity);
        any |= fits[j];
    }
    if (!any) {
        Py_SETREF(k.out[1], Py_NewRef(args[3]));
    }
    return kernel_done(&k, kernel_result(&k));
}

/* best_slot(hit_blocks, eligible) -> int: RequestView.best_slot, the eligible slot with the
 * longest hit (the first on ties; numpy's argmax, a NaN first of all), or -1 when its hit is
 * not positive. */
static Layout best_slot_args = {"best_slot", "d?"};

static PyObject *best_slot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &best_slot_args, args, nargs) < 0) {
        return kernel_done(&k, NULL);
    }
    if (k.n == 0) {
        /* An empty vector: numpy's argmax raises, and so does the reference. */
        return kernel_done(&k, Py_NewRef(Py_NotImplemented));
    }
    const double *hits = k.vec[0];
    const char *eligible = k.vec[1];
    Py_ssize_t best = 0;
    double bv = eligible[0] ? hits[0] : -1.0;
    for (Py_ssize_t j = 1; j < k.n && !isnan(bv); j++) {
        double x = eligible[j] ? hits[j] : -1.0;
        if (isnan(x) || x > bv) {
            best = j;
            bv = x;
        }
    }
    return kernel_done(&k, PyLong_FromSsize_t(bv > 0 ? best : -1));
}

/* ---- picking --------------------------------------------------------------------------------- */

/* masked_min(values, mask) -> float: np.min(values[mask]); ValueError when the mask is empty. */
static Layout masked_min_args = {"masked_min", "d?"};

static PyObject *masked_min(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &masked_min_args, args, nargs) < 0) {
        return kernel_done(&k, NULL);
    }
    const double *v = k.vec[0];
    const char *m = k.vec[1];
    int any = 0;
    double best = 0.0;
    for (Py_ssize_t j = 0; j < k.n; j++) {
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
    if (!any) {
        PyErr_SetString(PyExc_ValueError,
                        "zero-size array to reduction operation minimum which has no identity");
        return kernel_done(&k, NULL);
    }
    return kernel_done(&k, PyFloat_FromDouble(best));
}

/* numpy's sort order for doubles: NaN after everything. */
static inline int sort_lt(double a, double b) { return a < b || (isnan(b) && !isnan(a)); }

/* argmin(values, eligible, tiebreaks) -> int: pickers.argmin_eligible. */
static Layout argmin_args = {"argmin", "d?-"};

static PyObject *argmin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    /* The tiebreaks are checked before any vector is opened, as they always were. */
    PyObject *ties = nargs == 3 ? args[2] : NULL;
    if (ties != NULL && !PyTuple_Check(ties)) {
        PyErr_SetString(PyExc_TypeError, "tiebreaks: a tuple of vectors");
        return NULL;
    }
    if (ties != NULL && PyTuple_GET_SIZE(ties) > MAX_TIEBREAKS) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    Kernel k;
    if (kernel_open(&k, &argmin_args, args, nargs) < 0) {
        return kernel_done(&k, NULL);
    }
    Py_ssize_t keys = PyTuple_GET_SIZE(ties);
    const void *tie[MAX_TIEBREAKS];
    for (Py_ssize_t t = 0; t < keys; t++) {
        if (buffer_open(&k, PyTuple_GET_ITEM(ties, t), 'd', 1, &tie[t]) < 0) {
            return kernel_done(&k, NULL);
        }
    }
    const double *v = k.vec[0];
    const char *m = k.vec[1];
    Py_ssize_t n = k.n;
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
        return kernel_done(&k, NULL);
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
                    for (Py_ssize_t t = 0; t < keys; t++) {
                        const double *tv = tie[t];
                        a = m[j] ? tv[j] : INFINITY;
                        b = m[win] ? tv[win] : INFINITY;
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
    return kernel_done(&k, PyLong_FromSsize_t(best));
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

static Layout hit_vectors_args = {"hit_vectors", "----"};

static PyObject *hit_vectors(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &hit_vectors_args, args, nargs) < 0) {
        return kernel_done(&k, NULL);
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[0]);
    if (n == -1 && PyErr_Occurred()) {
        return kernel_done(&k, NULL);
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative number of slots");
        return kernel_done(&k, NULL);
    }
    if (!PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "matches: a tuple of dicts");
        return kernel_done(&k, NULL);
    }
    double bs = PyFloat_AsDouble(args[2]);
    if (bs == -1.0 && PyErr_Occurred()) {
        return kernel_done(&k, NULL);
    }
    double cap = PyFloat_AsDouble(args[3]);
    if (cap == -1.0 && PyErr_Occurred()) {
        return kernel_done(&k, NULL);
    }
    k.n = n;
    if (kernel_outputs(&k, "dd") < 0) {
        return kernel_done(&k, NULL);
    }
    double *blocks = k.made[0], *tokens = k.made[1], *pool = NULL;
    memset(blocks, 0, (size_t)n * sizeof(double));
    Py_ssize_t n_matches = PyTuple_GET_SIZE(args[1]);
    int earlier = 0; /* whether a match before the last holds anything */
    for (Py_ssize_t i = 0; i < n_matches; i++) {
        PyObject *match = PyTuple_GET_ITEM(args[1], i);
        if (i == n_matches - 1 && earlier) {
            /* The last match's blocks go to `pool` (its tokens are taken off at the end). */
            if (kernel_outputs(&k, "d") < 0) {
                return kernel_done(&k, NULL);
            }
            pool = memset(k.made[2], 0, (size_t)n * sizeof(double));
        }
        if (add_match(match, n, blocks, pool) < 0) {
            return kernel_done(&k, NULL);
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
    /* A pool vector with no token in it is answered None (kernel_done drops the vector). */
    return kernel_done(&k, PyTuple_Pack(3, k.out[0], k.out[1], any ? k.out[2] : Py_None));
}

/* ---- loading from the node's pool ------------------------------------------------------------ */

/* pool_load(pool_tokens, prefill, (setup, per_byte, kv_bytes_per_token, layers))
 *   -> (load, wait): cost.pool_load. */
static Layout pool_load_args = {"pool_load", "ddp"};

static PyObject *pool_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Kernel k;
    if (kernel_open(&k, &pool_load_args, args, nargs) < 0 || kernel_outputs(&k, "dd") < 0) {
        return kernel_done(&k, NULL);
    }
    const double *tokens = k.vec[0], *prefill = k.vec[1];
    double *load = k.made[0], *wait = k.made[1];
    const PoolConstants p = k.pool;
    for (Py_ssize_t j = 0; j < k.n; j++) {
        /* cost.pool_load, operation by operation as numpy evaluates it. */
        int loading = tokens[j] > 0;
        double moving = p.setup_s + (tokens[j] * p.kv_bytes_per_token) * p.per_byte;
        double l = loading ? moving : 0.0;
        double hidden = np_min(l, prefill[j]) / p.layers;
        double exposed = np_clip_low0(l - prefill[j]) + hidden;
        load[j] = l;
        wait[j] = loading ? exposed : 0.0;
    }
    return kernel_done(&k, kernel_result(&k));
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
