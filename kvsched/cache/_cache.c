/* Compiled paged prefix cache of one simulated engine. Same behaviour as the pure-Python
 * reference `kvsched.cache.prefix_cache.PrefixCache` (an agreement test drives both with the same
 * operations and compares every result, event and eviction); see that module for what each
 * method means. Only the simulator's replay uses this one: the live engine reads the
 * reference's `nodes`.
 *
 * Layout: a node per cached block in a fixed array of `total` nodes (a cached block holds a
 * page, so there are never more), reused through a free list; an open-addressing table
 * (linear probing, backward-shift deletion) from the u64 block hash to its node; and the LRU
 * as a binary heap of (last access, sequence number, node, node generation) entries ordered by
 * the first two, which are unique, so pops come in the reference's order whatever the heap's
 * layout. A node's generation changes when it is evicted, which makes its old heap entries
 * stale, as the reference's `nodes.get(node.hash) is not node` does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "hash_mix.h"

#define NIL (-1)

typedef struct {
    uint64_t hash;
    double last_access;
    int32_t parent;   /* NIL at the root; the free list's link while free */
    int32_t children; /* cached blocks continuing this one */
    int32_t lock;     /* requests holding a prefix through this block */
    uint32_t gen;     /* bumped on eviction: stale heap entries */
    uint64_t born;    /* the commit that created it (which blocks a commit stored) */
    uint64_t walked;  /* the touch_prefix run that set it and its ancestors to walk_now */
    uint8_t alive;
} Node;

typedef struct {
    double stamp;
    uint64_t seq;
    int32_t node;
    uint32_t gen;
} Entry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t total, free, private_, locked_nodes, n_nodes, evicted_total;
    Node *nodes;
    int32_t free_head;
    int32_t *table; /* node ids, NIL = empty */
    uint64_t mask;  /* table size - 1 (a power of two, at least twice `total`) */
    Entry *heap;
    Py_ssize_t heap_len, heap_cap;
    uint64_t seq, commits;
    uint64_t walks;  /* touch_prefix runs: a run ends with any other call that touches or locks */
    double walk_now; /* the run's `now` */
    PyObject *events; /* list, since the last drain */
    PyObject *stored_type, *removed_type; /* BlocksStored, BlocksRemoved */
} Cache;

static int32_t find(const Cache *c, uint64_t h) {
    uint64_t i = mix(h) & c->mask;
    for (;;) {
        int32_t n = c->table[i];
        if (n == NIL || c->nodes[n].hash == h) return n;
        i = (i + 1) & c->mask;
    }
}

static void table_insert(Cache *c, uint64_t h, int32_t n) {
    uint64_t i = mix(h) & c->mask;
    while (c->table[i] != NIL) i = (i + 1) & c->mask;
    c->table[i] = n;
}

static void table_delete(Cache *c, uint64_t h) {
    uint64_t i = mix(h) & c->mask;
    while (c->nodes[c->table[i]].hash != h) i = (i + 1) & c->mask;
    /* backward shift: move later entries of the run into the hole when their home allows */
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & c->mask;
        int32_t n = c->table[j];
        if (n == NIL) break;
        uint64_t home = mix(c->nodes[n].hash) & c->mask;
        /* n may move to i unless its home lies cyclically in (i, j] */
        if (((j - home) & c->mask) >= ((j - i) & c->mask)) {
            c->table[i] = n;
            i = j;
        }
    }
    c->table[i] = NIL;
}

/* ---- the LRU heap ------------------------------------------------------------------- */

static inline int entry_less(const Entry *a, const Entry *b) {
    return a->stamp < b->stamp || (a->stamp == b->stamp && a->seq < b->seq);
}

static int heap_push(Cache *c, int32_t n) {
    if (c->heap_len == c->heap_cap) {
        Py_ssize_t cap = c->heap_cap ? c->heap_cap * 2 : 64;
        Entry *grown = PyMem_Realloc(c->heap, (size_t)cap * sizeof(Entry));
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        c->heap = grown;
        c->heap_cap = cap;
    }
    c->seq += 1;
    Entry e = {c->nodes[n].last_access, c->seq, n, c->nodes[n].gen};
    Py_ssize_t i = c->heap_len++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) >> 1;
        if (!entry_less(&e, &c->heap[up])) break;
        c->heap[i] = c->heap[up];
        i = up;
    }
    c->heap[i] = e;
    return 0;
}

static Entry heap_pop(Cache *c) {
    Entry top = c->heap[0];
    Entry last = c->heap[--c->heap_len];
    Py_ssize_t i = 0, len = c->heap_len;
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= len) break;
        if (child + 1 < len && entry_less(&c->heap[child + 1], &c->heap[child])) child++;
        if (!entry_less(&c->heap[child], &last)) break;
        c->heap[i] = c->heap[child];
        i = child;
    }
    if (len > 0) c->heap[i] = last;
    return top;
}

/* ---- helpers ------------------------------------------------------------------------ */

static int hash_at(PyObject **items, Py_ssize_t i, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(items[i]);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

static PyObject *hash_obj(uint64_t h) { return PyLong_FromUnsignedLongLong(h); }

/* Appends `type(tuple_of_hashes, parent)` (parent omitted when `with_parent` is 0). */
static int emit(Cache *c, PyObject *type, PyObject *hashes_tuple, int with_parent,
                PyObject *parent) {
    PyObject *ev = with_parent
                       ? PyObject_CallFunctionObjArgs(type, hashes_tuple, parent, NULL)
                       : PyObject_CallFunctionObjArgs(type, hashes_tuple, NULL);
    Py_DECREF(hashes_tuple);
    if (!ev) return -1;
    int rc = PyList_Append(c->events, ev);
    Py_DECREF(ev);
    return rc;
}

/* ---- type --------------------------------------------------------------------------- */

static int Cache_init(Cache *c, PyObject *args, PyObject *kwds) {
    Py_ssize_t total;
    PyObject *stored, *removed;
    static char *kwlist[] = {"total_pages", "stored_type", "removed_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nOO", kwlist, &total, &stored, &removed))
        return -1;
    if (c->nodes) {
        PyErr_SetString(PyExc_RuntimeError, "a cache is initialised once");
        return -1;
    }
    if (total <= 0) {
        PyErr_SetString(PyExc_ValueError, "a cache needs at least one page");
        return -1;
    }
    if (total > INT32_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "too many pages for one cache");
        return -1;
    }
    uint64_t size = 16;
    while (size < (uint64_t)total * 2) size <<= 1;
    c->nodes = PyMem_Calloc((size_t)total, sizeof(Node));
    c->table = PyMem_Malloc((size_t)size * sizeof(int32_t));
    c->events = PyList_New(0);
    if (!c->nodes || !c->table || !c->events) {
        PyErr_NoMemory();
        return -1;
    }
    memset(c->table, 0xff, (size_t)size * sizeof(int32_t)); /* NIL everywhere */
    for (Py_ssize_t i = 0; i < total; i++) c->nodes[i].parent = (int32_t)(i + 1 < total ? i + 1 : NIL);
    c->free_head = 0;
    c->walks = 1; /* a node's `walked` starts at 0: in no run */
    c->mask = size - 1;
    c->total = c->free = total;
    Py_INCREF(stored);
    Py_INCREF(removed);
    c->stored_type = stored;
    c->removed_type = removed;
    return 0;
}

static void Cache_dealloc(Cache *c) {
    PyMem_Free(c->nodes);
    PyMem_Free(c->table);
    PyMem_Free(c->heap);
    Py_XDECREF(c->events);
    Py_XDECREF(c->stored_type);
    Py_XDECREF(c->removed_type);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* The (hashes, limit) of match and chain_match: `hashes` as a fast sequence (a new reference;
 * NULL with an error set) with its items, and how many of them to look at (at most `limit`,
 * at least 0). */
static PyObject *hashes_upto(PyObject *const *args, Py_ssize_t nargs, const char *usage,
                             PyObject ***items, Py_ssize_t *n) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "hashes must be a sequence");
    if (!seq) return NULL;
    *items = PySequence_Fast_ITEMS(seq);
    *n = PySequence_Fast_GET_SIZE(seq);
    if (limit < *n) *n = limit;
    if (*n < 0) *n = 0;
    return seq;
}

static PyObject *Cache_match(Cache *c, PyObject *const *args, Py_ssize_t nargs) {
    PyObject **items;
    Py_ssize_t hi, lo = 0;
    PyObject *seq = hashes_upto(args, nargs, "match(hashes, limit)", &items, &hi);
    if (!seq) return NULL;
    uint64_t h;
    Py_ssize_t result = 0;
    if (hi <= 0) goto done;
    if (hash_at(items, 0, &h) < 0) goto fail;
    if (find(c, h) == NIL) goto done;
    if (hash_at(items, hi - 1, &h) < 0) goto fail;
    if (find(c, h) != NIL) {
        result = hi;
        goto done;
    }
    lo = 1;
    while (lo < hi - 1) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (hash_at(items, mid - 1, &h) < 0) goto fail;
        if (find(c, h) != NIL)
            lo = mid;
        else
            hi = mid;
    }
    result = lo;
done:
    Py_DECREF(seq);
    return PyLong_FromSsize_t(result);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Cache_chain_match(Cache *c, PyObject *const *args, Py_ssize_t nargs) {
    PyObject **items;
    Py_ssize_t n;
    PyObject *seq = hashes_upto(args, nargs, "chain_match(hashes, limit)", &items, &n);
    if (!seq) return NULL;
    int32_t parent = NIL;
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        uint64_t h;
        if (hash_at(items, i, &h) < 0) {
            /* a hash no u64 can be is not cached */
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                Py_DECREF(seq);
                return NULL;
            }
            PyErr_Clear();
            break;
        }
        int32_t node = find(c, h);
        if (node == NIL || c->nodes[node].parent != parent) break;
        parent = node;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(i);
}

/* The node of hashes[n-1] (KeyError when it is not cached), or NIL when n <= 0. */
static int lookup_nth(Cache *c, PyObject *hashes, Py_ssize_t n, int32_t *out) {
    *out = NIL;
    if (n <= 0) return 0;
    PyObject *obj = PySequence_GetItem(hashes, n - 1);
    if (!obj) return -1;
    unsigned long long h = PyLong_AsUnsignedLongLong(obj);
    if (h == (unsigned long long)-1 && PyErr_Occurred()) {
        Py_DECREF(obj);
        return -1;
    }
    int32_t node = find(c, (uint64_t)h);
    if (node == NIL) {
        PyErr_SetObject(PyExc_KeyError, obj);
        Py_DECREF(obj);
        return -1;
    }
    Py_DECREF(obj);
    *out = node;
    return 0;
}

/* lock_prefix (step +1) and unlock_prefix (step -1): a request starts or stops holding the
 * first n blocks of `hashes`, walking from hashes[n-1]'s node to the root. A node unlocked to 0
 * with no cached child becomes evictable (pushed to the LRU after its touch). */
static PyObject *lock_walk(Cache *c, PyObject *args, PyObject *kwds, int step) {
    PyObject *hashes;
    Py_ssize_t n;
    double now;
    int touch = 1;
    static char *kwlist[] = {"hashes", "n", "now", "touch", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ond|$p", kwlist, &hashes, &n, &now, &touch))
        return NULL;
    int32_t node;
    if (lookup_nth(c, hashes, n, &node) < 0) return NULL;
    c->walks += 1;
    while (node != NIL) {
        Node *nd = &c->nodes[node];
        if (step > 0 && nd->lock == 0) c->locked_nodes += 1;
        nd->lock += step;
        if (touch) nd->last_access = now;
        if (step < 0 && nd->lock == 0) {
            c->locked_nodes -= 1;
            if (nd->children == 0 && heap_push(c, node) < 0) return NULL;
        }
        node = nd->parent;
    }
    Py_RETURN_NONE;
}

static PyObject *Cache_lock_prefix(Cache *c, PyObject *args, PyObject *kwds) {
    return lock_walk(c, args, kwds, +1);
}

static PyObject *Cache_unlock_prefix(Cache *c, PyObject *args, PyObject *kwds) {
    return lock_walk(c, args, kwds, -1);
}

/* touch_prefix: lock_prefix then unlock_prefix, in one walk that stops at the first ancestor
 * this run of touches already set (its own ancestors were set with it). A run is the
 * touch_prefix calls at one `now` with no other lock, unlock or commit between them: within
 * it nothing else sets an access time or a lock, and a live node's ancestors never change, so
 * the walk it skips would only write `now` where `now` already is. A node tier's write-backs
 * touch the whole chain of every block a GPU evicts, leaf after leaf of one long chain at one
 * time: the full walks made those quadratic in the chain's length. */
static PyObject *Cache_touch_prefix(Cache *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "touch_prefix(hashes, n, now)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    double now = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred()) return NULL;
    int32_t node;
    if (lookup_nth(c, args[0], n, &node) < 0) return NULL;
    if (node == NIL) Py_RETURN_NONE;
    if (now != c->walk_now) {
        c->walks += 1;
        c->walk_now = now;
    }
    Node *end = &c->nodes[node];
    end->last_access = now;
    if (end->lock == 0 && end->children == 0 && heap_push(c, node) < 0) return NULL;
    end->walked = c->walks;
    /* the nodes above have a child each (the walk's own path), so none becomes evictable */
    node = end->parent;
    while (node != NIL && c->nodes[node].walked != c->walks) {
        Node *nd = &c->nodes[node];
        nd->last_access = now;
        nd->walked = c->walks;
        node = nd->parent;
    }
    Py_RETURN_NONE;
}

static int evict(Cache *c, Py_ssize_t pages) {
    PyObject *removed = PyList_New(0);
    if (!removed) return -1;
    while (pages > 0 && c->heap_len > 0) {
        Entry e = heap_pop(c);
        Node *nd = &c->nodes[e.node];
        if (!nd->alive || nd->gen != e.gen || nd->lock || nd->children ||
            nd->last_access != e.stamp)
            continue; /* stale entry: the node was touched, locked or already evicted */
        PyObject *h = hash_obj(nd->hash);
        if (!h || PyList_Append(removed, h) < 0) {
            Py_XDECREF(h);
            Py_DECREF(removed);
            return -1;
        }
        Py_DECREF(h);
        table_delete(c, nd->hash);
        nd->alive = 0;
        nd->gen += 1;
        int32_t parent = nd->parent;
        nd->parent = c->free_head;
        c->free_head = e.node;
        c->n_nodes -= 1;
        pages -= 1;
        if (parent != NIL) {
            Node *pn = &c->nodes[parent];
            pn->children -= 1;
            if (pn->children == 0 && pn->lock == 0 && heap_push(c, parent) < 0) {
                Py_DECREF(removed);
                return -1;
            }
        }
    }
    Py_ssize_t count = PyList_GET_SIZE(removed);
    c->free += count;
    c->evicted_total += count;
    if (count == 0) {
        Py_DECREF(removed);
        return 0;
    }
    PyObject *tup = PyList_AsTuple(removed);
    Py_DECREF(removed);
    if (!tup) return -1;
    return emit(c, c->removed_type, tup, 0, NULL);
}

static PyObject *Cache_reserve(Cache *c, PyObject *arg) {
    Py_ssize_t pages = PyLong_AsSsize_t(arg);
    if (pages == -1 && PyErr_Occurred()) return NULL;
    if (pages > c->free + c->n_nodes - c->locked_nodes) Py_RETURN_FALSE;
    if (pages > c->free && evict(c, pages - c->free) < 0) return NULL;
    c->free -= pages;
    c->private_ += pages;
    Py_RETURN_TRUE;
}

static PyObject *Cache_release(Cache *c, PyObject *arg) {
    Py_ssize_t pages = PyLong_AsSsize_t(arg);
    if (pages == -1 && PyErr_Occurred()) return NULL;
    if (pages < 0 || pages > c->private_) {
        PyErr_SetString(PyExc_AssertionError, "releasing pages that were never reserved");
        return NULL;
    }
    c->private_ -= pages;
    c->free += pages;
    Py_RETURN_NONE;
}

/* BlocksStored events for the blocks of hashes[start:end] this commit created, one per run
 * with its own parent (the reference's `_record_stored`). */
static int record_stored(Cache *c, PyObject **items, Py_ssize_t start, Py_ssize_t end,
                         Py_ssize_t used) {
    Py_ssize_t i = start;
    while (i < end) {
        Py_ssize_t first = i;
        if (used == end - start) {
            i = end; /* all new: one run, no lookups */
        } else {
            /* the next run of blocks born in this commit */
            uint64_t h;
            for (; i < end; i++) {
                if (hash_at(items, i, &h) < 0) return -1;
                if (c->nodes[find(c, h)].born == c->commits) break;
            }
            if (i == end) break;
            first = i;
            for (; i < end; i++) {
                if (hash_at(items, i, &h) < 0) return -1;
                if (c->nodes[find(c, h)].born != c->commits) break;
            }
        }
        PyObject *tup = PyTuple_New(i - first);
        if (!tup) return -1;
        for (Py_ssize_t k = first; k < i; k++) {
            Py_INCREF(items[k]);
            PyTuple_SET_ITEM(tup, k - first, items[k]);
        }
        PyObject *parent = first > 0 ? items[first - 1] : Py_None;
        if (emit(c, c->stored_type, tup, 1, parent) < 0) return -1;
    }
    return 0;
}

static PyObject *Cache_commit(Cache *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "commit(hashes, start, end, held, now)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    Py_ssize_t held = PyLong_AsSsize_t(args[3]);
    double now = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (held != start) {
        PyErr_SetString(PyExc_AssertionError, "blocks must be committed in order");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "hashes must be a sequence");
    if (!seq) return NULL;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (end > len) end = len;
    if (start < 0 || start > end) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "commit needs 0 <= start <= end");
        return NULL;
    }
    if (end - start > c->private_) {
        /* every computed block sits in a private page: more would overfill the cache */
        Py_DECREF(seq);
        PyErr_SetString(PyExc_AssertionError, "committing more blocks than pages reserved");
        return NULL;
    }
    uint64_t h;
    int32_t parent = NIL;
    if (start > 0) {
        if (hash_at(items, start - 1, &h) < 0) goto fail;
        parent = find(c, h);
        if (parent == NIL) {
            PyErr_SetObject(PyExc_KeyError, items[start - 1]);
            goto fail;
        }
    }
    /* every hash must be a u64 before anything changes */
    for (Py_ssize_t i = start; i < end; i++)
        if (hash_at(items, i, &h) < 0) goto fail;
    c->commits += 1;
    c->walks += 1;
    Py_ssize_t used = 0, relocked = 0;
    for (Py_ssize_t i = start; i < end; i++) {
        hash_at(items, i, &h);
        int32_t node = find(c, h);
        if (node == NIL) {
            node = c->free_head;
            Node *nd = &c->nodes[node];
            c->free_head = nd->parent;
            nd->hash = h;
            nd->parent = parent;
            nd->children = 0;
            nd->lock = 1;
            nd->last_access = now;
            nd->born = c->commits;
            nd->alive = 1;
            table_insert(c, h, node);
            c->n_nodes += 1;
            if (parent != NIL) c->nodes[parent].children += 1;
            used += 1;
        } else {
            Node *nd = &c->nodes[node];
            if (nd->lock == 0) relocked += 1;
            nd->lock += 1;
            nd->last_access = now;
        }
        parent = node;
    }
    c->private_ -= end - start;
    c->free += end - start - used;
    c->locked_nodes += used + relocked;
    if (used && record_stored(c, items, start, end, used) < 0) goto fail;
    Py_DECREF(seq);
    return PyLong_FromSsize_t(used);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Cache_drain_events(Cache *c, PyObject *unused) {
    PyObject *fresh = PyList_New(0);
    if (!fresh) return NULL;
    PyObject *events = c->events;
    c->events = fresh;
    return events;
}

static PyObject *Cache_snapshot(Cache *c, PyObject *unused) {
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < c->total; i++) {
        Node *nd = &c->nodes[i];
        if (!nd->alive) continue;
        PyObject *key = hash_obj(nd->hash);
        PyObject *parent = !key                 ? NULL
                           : nd->parent == NIL ? (Py_INCREF(Py_None), Py_None)
                                               : hash_obj(c->nodes[nd->parent].hash);
        /* "N" hands `parent` over to the tuple, or releases it on failure */
        PyObject *val = parent ? Py_BuildValue("(Niid)", parent, (int)nd->children,
                                               (int)nd->lock, nd->last_access)
                               : NULL;
        if (!val || PyDict_SetItem(out, key, val) < 0) {
            Py_XDECREF(key);
            Py_XDECREF(val);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(val);
    }
    return out;
}

static PyObject *fail_integrity(const char *what) {
    PyErr_SetString(PyExc_AssertionError, what);
    return NULL;
}

static PyObject *Cache_check_integrity(Cache *c, PyObject *unused) {
    if (c->free < 0 || c->private_ < 0) return fail_integrity("negative page count");
    if (c->free + c->n_nodes + c->private_ != c->total)
        return fail_integrity("free + evictable + locked != total");
    int32_t *children = PyMem_Calloc((size_t)c->total, sizeof(int32_t));
    if (!children) return PyErr_NoMemory();
    Py_ssize_t locked = 0, alive = 0;
    const char *bad = NULL;
    for (Py_ssize_t i = 0; i < c->total && !bad; i++) {
        Node *nd = &c->nodes[i];
        if (!nd->alive) continue;
        alive++;
        if (find(c, nd->hash) != (int32_t)i) bad = "table out of step";
        if (nd->parent != NIL) {
            if (!c->nodes[nd->parent].alive) bad = "orphan block";
            children[nd->parent]++;
            if (nd->lock && c->nodes[nd->parent].lock < nd->lock) bad = "lock not on path";
        }
        if (nd->lock < 0) bad = "negative lock";
        locked += nd->lock > 0;
    }
    for (Py_ssize_t i = 0; i < c->total && !bad; i++)
        if (c->nodes[i].alive && c->nodes[i].children != children[i])
            bad = "child count out of step";
    PyMem_Free(children);
    if (!bad && alive != c->n_nodes) bad = "node count out of step";
    if (!bad && locked != c->locked_nodes) bad = "locked count out of step";
    if (bad) return fail_integrity(bad);
    Py_RETURN_NONE;
}

static Py_ssize_t Cache_len(Cache *c) { return c->n_nodes; }

#define SIZE_GETTER(name, expr)                                                          \
    static PyObject *Cache_get_##name(Cache *c, void *unused) {                          \
        return PyLong_FromSsize_t(expr);                                                 \
    }
SIZE_GETTER(total, c->total)
SIZE_GETTER(free, c->free)
SIZE_GETTER(private, c->private_)
SIZE_GETTER(locked_nodes, c->locked_nodes)
SIZE_GETTER(evictable, c->n_nodes - c->locked_nodes)
SIZE_GETTER(locked, c->locked_nodes + c->private_)
SIZE_GETTER(available, c->free + c->n_nodes - c->locked_nodes)
SIZE_GETTER(evicted_total, c->evicted_total)

static PyGetSetDef Cache_getset[] = {
    {"total", (getter)Cache_get_total, NULL, "pages in all", NULL},
    {"free", (getter)Cache_get_free, NULL, "pages not allocated", NULL},
    {"private", (getter)Cache_get_private, NULL, "pages reserved by requests", NULL},
    {"locked_nodes", (getter)Cache_get_locked_nodes, NULL, "cached blocks in use", NULL},
    {"evictable", (getter)Cache_get_evictable, NULL, "cached blocks nobody holds", NULL},
    {"locked", (getter)Cache_get_locked, NULL, "pages in use", NULL},
    {"available", (getter)Cache_get_available, NULL, "pages a reservation could get", NULL},
    {"evicted_total", (getter)Cache_get_evicted_total, NULL, "blocks evicted so far", NULL},
    {NULL},
};

static PyMethodDef Cache_methods[] = {
    {"match", (PyCFunction)(void (*)(void))Cache_match, METH_FASTCALL, NULL},
    {"chain_match", (PyCFunction)(void (*)(void))Cache_chain_match, METH_FASTCALL, NULL},
    {"lock_prefix", (PyCFunction)(void (*)(void))Cache_lock_prefix, METH_VARARGS | METH_KEYWORDS,
     NULL},
    {"unlock_prefix", (PyCFunction)(void (*)(void))Cache_unlock_prefix,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {"touch_prefix", (PyCFunction)(void (*)(void))Cache_touch_prefix, METH_FASTCALL, NULL},
    {"reserve", (PyCFunction)Cache_reserve, METH_O, NULL},
    {"release", (PyCFunction)Cache_release, METH_O, NULL},
    {"commit", (PyCFunction)(void (*)(void))Cache_commit, METH_FASTCALL, NULL},
    {"drain_events", (PyCFunction)Cache_drain_events, METH_NOARGS, NULL},
    {"snapshot", (PyCFunction)Cache_snapshot, METH_NOARGS, NULL},
    {"check_integrity", (PyCFunction)Cache_check_integrity, METH_NOARGS, NULL},
    {NULL},
};

static PySequenceMethods Cache_as_sequence = {.sq_length = (lenfunc)Cache_len};

static PyTypeObject CacheType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvsched.cache._cache.Cache",
    .tp_basicsize = sizeof(Cache),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pages, cached blocks and locks of one simulated engine (compiled).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Cache_init,
    .tp_dealloc = (destructor)Cache_dealloc,
    .tp_methods = Cache_methods,
    .tp_getset = Cache_getset,
    .tp_as_sequence = &Cache_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvsched.cache._cache",
    "Compiled prefix cache of an engine's KV (see kvsched.cache.prefix_cache).", -1, NULL,
};

PyMODINIT_FUNC PyInit__cache(void) {
    if (PyType_Ready(&CacheType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CacheType);
    if (PyModule_AddObject(m, "Cache", (PyObject *)&CacheType) < 0) {
        Py_DECREF(&CacheType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
