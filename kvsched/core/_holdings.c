/* Compiled block holdings of the prefix index: block -> holder bitset per tier, the chain
 * links between blocks, and the chain match. Same behaviour as the pure-Python reference in
 * kvsched/core/holdings.py (a property test drives both with the same operations); see that
 * module for what each method means.
 *
 * Layout (per block, GPU tier only): a 24-byte entry (hash, parent, first child, next and
 * previous sibling: a block leaves its parent's children in constant time however many
 * chains continue that parent, as every conversation continues a shared system prompt),
 * one 8-byte holder word per tier in use, and a 4-byte bucket in an open-addressing table at
 * most 3/4 full. Entries and holder words live in fixed-size pages, so growth never copies them
 * and a freed entry is reused. With 64 slots or fewer the holder word is the holders' bitset;
 * with more it lists up to three holders inline (21 bits each: slot + 1, 0 for none) and
 * otherwise points at a full bitset in an overflow pool (top bit set), so a block costs the
 * same at 1,024 instances as at 64 unless four or more instances hold it. A block's entry lives while some slot
 * holds it in some tier or some block names it as parent (a parent an engine never reported:
 * its children must still leave with it if it is stored and removed later, as the reference
 * does).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "hash_mix.h"

#define NONE UINT32_MAX
#define N_TIERS 3
#define PAGE_BITS 16
#define PAGE_SIZE (1u << PAGE_BITS)
#define PAGE_MASK (PAGE_SIZE - 1)

#pragma pack(push, 4)
typedef struct {
    uint64_t hash;
    uint32_t parent;       /* entry of the parent block, NONE at the root or while unheld */
    uint32_t first_child;  /* children: blocks stored with this one as parent, newest first */
    uint32_t next_sibling;
    uint32_t prev_sibling; /* NONE for the parent's first child */
} Entry;
#pragma pack(pop)

typedef struct {
    PyObject_HEAD
    Py_ssize_t n_slots;
    Py_ssize_t words;            /* u64 words per holder bitset */
    Entry **pages;               /* entry i is pages[i >> PAGE_BITS][i & PAGE_MASK] */
    uint64_t **mask_pages[N_TIERS]; /* holder words of entry i in tier t, NULL until used */
    uint32_t n_pages;
    uint32_t page_cap;
    uint32_t n_entries;          /* entries ever handed out (the free list reuses them) */
    uint32_t free_head;
    uint32_t *table;             /* open addressing, linear probing: entry ids, NONE = empty */
    uint64_t table_cap;          /* a power of two */
    uint64_t table_used;
    Py_ssize_t held;             /* blocks held anywhere (in any tier by any slot) */
    int64_t *counts;             /* counts[tier * n_slots + slot] */
    uint64_t *scratch;           /* 3 bitsets of `words` words for match */
    uint64_t *pool;              /* overflow bitsets (more than 64 slots): `words` words each */
    uint32_t pool_cap, pool_next, pool_free, pool_live;
    uint64_t unknown_parents, duplicate_stores, absent_removals, cascaded_removals;
} Holdings;

static inline Entry *entry(Holdings *self, uint32_t i) {
    return &self->pages[i >> PAGE_BITS][i & PAGE_MASK];
}

/* The holder word of entry i in tier t; NULL while its page was never written. */
static inline uint64_t *holder_word(Holdings *self, int tier, uint32_t i) {
    uint64_t **pages = self->mask_pages[tier];
    if (pages == NULL || pages[i >> PAGE_BITS] == NULL) return NULL;
    return pages[i >> PAGE_BITS] + (i & PAGE_MASK);
}

static inline uint64_t holders_of(Holdings *self, int tier, uint32_t i) {
    uint64_t *w = holder_word(self, tier, i);
    return w == NULL ? 0 : *w;
}

/* The holder word of entry i in tier t, its page allocated (zeroed) on first use; NULL if out
 * of memory (with the Python error set). */
static uint64_t *holder_word_for_write(Holdings *self, int tier, uint32_t i) {
    if (self->mask_pages[tier] == NULL) {
        self->mask_pages[tier] = PyMem_Calloc(self->page_cap, sizeof(uint64_t *));
        if (self->mask_pages[tier] == NULL) { PyErr_NoMemory(); return NULL; }
    }
    uint64_t **pages = self->mask_pages[tier];
    if (pages[i >> PAGE_BITS] == NULL) {
        pages[i >> PAGE_BITS] = PyMem_Calloc(PAGE_SIZE, sizeof(uint64_t));
        if (pages[i >> PAGE_BITS] == NULL) { PyErr_NoMemory(); return NULL; }
    }
    return pages[i >> PAGE_BITS] + (i & PAGE_MASK);
}

/* ---- holder words ------------------------------------------------------------------------
 * A word is 0 exactly when nobody holds the block. Above 64 slots: OVERFLOW | pool index, or
 * up to three inline fields of FIELD_BITS bits, each 0 (free) or slot + 1. */

#define OVERFLOW (1ULL << 63)
#define FIELD_BITS 21
#define FIELD_MASK ((1ULL << FIELD_BITS) - 1)
#define MAX_SPARSE_SLOTS ((Py_ssize_t)FIELD_MASK - 1)

static inline int sparse(Holdings *self) { return self->words > 1; }

static inline uint64_t *pool_bits(Holdings *self, uint64_t w) {
    return self->pool + (size_t)(uint32_t)w * self->words;
}

static inline uint64_t field(uint64_t w, int k) { return (w >> (k * FIELD_BITS)) & FIELD_MASK; }

static inline int h_has(Holdings *self, uint64_t w, Py_ssize_t slot) {
    if (!sparse(self)) return (w >> slot) & 1;
    if (w & OVERFLOW) return (pool_bits(self, w)[slot >> 6] >> (slot & 63)) & 1;
    uint64_t want = (uint64_t)slot + 1;
    return field(w, 0) == want || field(w, 1) == want || field(w, 2) == want;
}

/* Make sure one overflow bitset is free, so that adding a holder cannot fail. */
static int pool_reserve(Holdings *self) {
    if (self->pool_free != NONE || self->pool_next < self->pool_cap) return 0;
    uint32_t cap = self->pool_cap ? self->pool_cap * 2 : 1024;
    uint64_t *pool = PyMem_Realloc(self->pool, (size_t)cap * self->words * sizeof(uint64_t));
    if (pool == NULL) { PyErr_NoMemory(); return -1; }
    self->pool = pool;
    self->pool_cap = cap;
    return 0;
}

/* Add `slot` (not yet a holder) to *w; pool_reserve must have succeeded first. */
static void h_add(Holdings *self, uint64_t *w, Py_ssize_t slot) {
    if (!sparse(self)) { *w |= 1ULL << slot; return; }
    if (*w & OVERFLOW) { pool_bits(self, *w)[slot >> 6] |= 1ULL << (slot & 63); return; }
    for (int k = 0; k < 3; k++) {
        if (field(*w, k) == 0) { *w |= ((uint64_t)slot + 1) << (k * FIELD_BITS); return; }
    }
    /* A fourth holder: move the three to a bitset of the pool. */
    uint32_t idx = self->pool_free;
    if (idx != NONE) self->pool_free = (uint32_t)self->pool[(size_t)idx * self->words];
    else idx = self->pool_next++;
    self->pool_live++;
    uint64_t *bits = self->pool + (size_t)idx * self->words;
    memset(bits, 0, self->words * sizeof(uint64_t));
    for (int k = 0; k < 3; k++) {
        uint64_t s = field(*w, k) - 1;
        bits[s >> 6] |= 1ULL << (s & 63);
    }
    bits[slot >> 6] |= 1ULL << (slot & 63);
    *w = OVERFLOW | idx;
}

/* Remove `slot` (a holder) from *w; returns whether nobody holds the block now. */
static int h_remove(Holdings *self, uint64_t *w, Py_ssize_t slot) {
    if (!sparse(self)) { *w &= ~(1ULL << slot); return *w == 0; }
    if (*w & OVERFLOW) {
        uint64_t *bits = pool_bits(self, *w);
        bits[slot >> 6] &= ~(1ULL << (slot & 63));
        for (Py_ssize_t k = 0; k < self->words; k++) if (bits[k]) return 0;
        uint32_t idx = (uint32_t)*w;  /* empty: back to the free list */
        bits[0] = self->pool_free;
        self->pool_free = idx;
        self->pool_live--;
        *w = 0;
        return 1;
    }
    for (int k = 0; k < 3; k++) {
        if (field(*w, k) == (uint64_t)slot + 1) *w &= ~(FIELD_MASK << (k * FIELD_BITS));
    }
    return *w == 0;
}

/* The holders of w as a bitset of `words` words. */
static void h_expand(Holdings *self, uint64_t w, uint64_t *out) {
    if (!sparse(self)) { out[0] = w; return; }
    if (w & OVERFLOW) { memcpy(out, pool_bits(self, w), self->words * sizeof(uint64_t)); return; }
    memset(out, 0, self->words * sizeof(uint64_t));
    for (int k = 0; k < 3; k++) {
        uint64_t s = field(w, k);
        if (s) out[(s - 1) >> 6] |= 1ULL << ((s - 1) & 63);
    }
}

/* Whether every slot in the bitset `alive` holds the block of word w. */
static int h_covers(Holdings *self, uint64_t w, const uint64_t *alive) {
    if (!sparse(self)) return (w & alive[0]) == alive[0];
    if (w & OVERFLOW) {
        const uint64_t *bits = pool_bits(self, w);
        for (Py_ssize_t k = 0; k < self->words; k++)
            if ((bits[k] & alive[k]) != alive[k]) return 0;
        return 1;
    }
    for (Py_ssize_t k = 0; k < self->words; k++) {
        uint64_t rest = alive[k];
        while (rest) {
            int bit = __builtin_ctzll(rest);
            rest &= rest - 1;
            if (!h_has(self, w, k * 64 + bit)) return 0;
        }
    }
    return 1;
}

/* out = the holders of w that are in `alive`. */
static void h_and(Holdings *self, uint64_t w, const uint64_t *alive, uint64_t *out) {
    h_expand(self, w, out);
    for (Py_ssize_t k = 0; k < self->words; k++) out[k] &= alive[k];
}

static inline int any_bits(const uint64_t *m, Py_ssize_t words) {
    for (Py_ssize_t w = 0; w < words; w++) if (m[w]) return 1;
    return 0;
}

static int held_anywhere(Holdings *self, uint32_t i) {
    for (int t = 0; t < N_TIERS; t++)
        if (holders_of(self, t, i)) return 1;
    return 0;
}

static PyObject *bits_to_int(Holdings *self, const uint64_t *bits) {
    if (self->words == 1) return PyLong_FromUnsignedLongLong(bits[0]);
    /* Build the int from its little-endian bytes. */
    return _PyLong_FromByteArray((const unsigned char *)bits, self->words * 8, 1, 0);
}

/* ---- hash table ------------------------------------------------------------------------ */

static uint32_t lookup(Holdings *self, uint64_t h) {
    uint64_t cap_mask = self->table_cap - 1;
    for (uint64_t b = mix(h) & cap_mask;; b = (b + 1) & cap_mask) {
        uint32_t i = self->table[b];
        if (i == NONE) return NONE;
        if (entry(self, i)->hash == h) return i;
    }
}

static void table_put(uint32_t *table, uint64_t cap, uint64_t h, uint32_t i) {
    uint64_t b = mix(h) & (cap - 1);
    while (table[b] != NONE) b = (b + 1) & (cap - 1);
    table[b] = i;
}

static int grow_table(Holdings *self) {
    uint64_t cap = self->table_cap * 2;
    uint32_t *table = PyMem_Malloc(cap * sizeof(uint32_t));
    if (table == NULL) { PyErr_NoMemory(); return -1; }
    memset(table, 0xff, cap * sizeof(uint32_t));
    for (uint64_t b = 0; b < self->table_cap; b++)
        if (self->table[b] != NONE) table_put(table, cap, entry(self, self->table[b])->hash,
                                              self->table[b]);
    PyMem_Free(self->table);
    self->table = table;
    self->table_cap = cap;
    return 0;
}

/* Delete h's bucket; backward-shift the probe run behind it (no tombstones). */
static void table_delete(Holdings *self, uint64_t h) {
    uint64_t cap_mask = self->table_cap - 1;
    uint64_t b = mix(h) & cap_mask;
    while (entry(self, self->table[b])->hash != h) b = (b + 1) & cap_mask;
    uint64_t hole = b;
    for (uint64_t j = (hole + 1) & cap_mask; self->table[j] != NONE; j = (j + 1) & cap_mask) {
        uint64_t home = mix(entry(self, self->table[j])->hash) & cap_mask;
        /* Move j into the hole unless its home lies cyclically in (hole, j]. */
        if (((j - home) & cap_mask) >= ((j - hole) & cap_mask)) {
            self->table[hole] = self->table[j];
            hole = j;
        }
    }
    self->table[hole] = NONE;
    self->table_used--;
}

/* The entry of h, created unheld and unlinked if absent; NONE if out of memory. */
static uint32_t intern(Holdings *self, uint64_t h) {
    uint32_t i = lookup(self, h);
    if (i != NONE) return i;
    if ((self->table_used + 1) * 4 > self->table_cap * 3 && grow_table(self) < 0) return NONE;
    if (self->free_head != NONE) {
        i = self->free_head;
        self->free_head = entry(self, i)->parent;
    } else {
        if (self->n_entries == NONE - 1) { PyErr_SetString(PyExc_MemoryError, "index full"); return NONE; }
        i = self->n_entries;
        if ((i >> PAGE_BITS) >= self->n_pages) {
            if (self->n_pages == self->page_cap) {
                uint32_t cap = self->page_cap * 2;
                Entry **pages = PyMem_Realloc(self->pages, cap * sizeof(Entry *));
                if (pages == NULL) { PyErr_NoMemory(); return NONE; }
                self->pages = pages;
                for (int t = 0; t < N_TIERS; t++) {
                    if (self->mask_pages[t] == NULL) continue;
                    uint64_t **mp = PyMem_Realloc(self->mask_pages[t], cap * sizeof(uint64_t *));
                    if (mp == NULL) { PyErr_NoMemory(); return NONE; }
                    memset(mp + self->page_cap, 0, (cap - self->page_cap) * sizeof(uint64_t *));
                    self->mask_pages[t] = mp;
                }
                self->page_cap = cap;
            }
            self->pages[self->n_pages] = PyMem_Malloc(PAGE_SIZE * sizeof(Entry));
            if (self->pages[self->n_pages] == NULL) { PyErr_NoMemory(); return NONE; }
            self->n_pages++;
        }
        self->n_entries++;
    }
    Entry *e = entry(self, i);
    e->hash = h;
    e->parent = e->first_child = e->next_sibling = e->prev_sibling = NONE;
    table_put(self->table, self->table_cap, h, i);
    self->table_used++;
    return i;
}

/* Forget entry i (unheld and childless): its bucket goes, the entry joins the free list. */
static void release(Holdings *self, uint32_t i) {
    Entry *e = entry(self, i);
    table_delete(self, e->hash);
    e->parent = self->free_head;
    self->free_head = i;
}

static void release_if_unused(Holdings *self, uint32_t i) {
    Entry *e = entry(self, i);
    if (e->first_child == NONE && e->parent == NONE && !held_anywhere(self, i)) release(self, i);
}

/* ---- links ----------------------------------------------------------------------------- */

/* Entry i is held nowhere any more: take it off its parent's children (the reference's
 * `_unlink_if_unheld`), and forget the parent and i where nothing keeps them. */
static void unlink_if_unheld(Holdings *self, uint32_t i) {
    if (held_anywhere(self, i)) return;
    Entry *e = entry(self, i);
    self->held--;
    uint32_t p = e->parent;
    if (p != NONE) {
        if (e->prev_sibling == NONE) entry(self, p)->first_child = e->next_sibling;
        else entry(self, e->prev_sibling)->next_sibling = e->next_sibling;
        if (e->next_sibling != NONE) entry(self, e->next_sibling)->prev_sibling = e->prev_sibling;
        e->parent = e->next_sibling = e->prev_sibling = NONE;
        if (p != i) release_if_unused(self, p);
    }
    release_if_unused(self, i);
}

/* Clear `slot` in entry i's holder words of `tier`; unlink i if nothing holds it now. */
static void unset(Holdings *self, int tier, Py_ssize_t slot, uint32_t i) {
    int empty = h_remove(self, holder_word(self, tier, i), slot);
    self->counts[tier * self->n_slots + slot]--;
    if (empty) unlink_if_unheld(self, i);
}

/* ---- argument helpers ------------------------------------------------------------------ */

static int read_hash(PyObject *obj, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a block hash must be an int, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    uint64_t h = PyLong_AsUnsignedLongLong(obj);
    if (h == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_OverflowError, "a block hash must be an unsigned 64-bit integer");
        return -1;
    }
    *out = h;
    return 0;
}

static int check_slot_tier(Holdings *self, Py_ssize_t slot, int tier) {
    if (slot < 0 || slot >= self->n_slots) {
        PyErr_Format(PyExc_IndexError, "slot %zd out of range (%zd slots)", slot, self->n_slots);
        return -1;
    }
    if (tier < 0 || tier >= N_TIERS) {
        PyErr_Format(PyExc_ValueError, "tier %d out of range", tier);
        return -1;
    }
    return 0;
}

/* The hashes of `seq` as a C array (caller frees); NULL on error. */
static uint64_t *read_hashes(PyObject *seq, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, "block hashes must be a sequence");
    if (fast == NULL) return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t *out = PyMem_Malloc((*n ? *n : 1) * sizeof(uint64_t));
    if (out == NULL) { Py_DECREF(fast); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t k = 0; k < *n; k++) {
        if (read_hash(items[k], &out[k]) < 0) { PyMem_Free(out); Py_DECREF(fast); return NULL; }
    }
    Py_DECREF(fast);
    return out;
}

static PyObject *hash_obj(uint64_t h) { return PyLong_FromUnsignedLongLong(h); }

/* ---- type ------------------------------------------------------------------------------ */

static void Holdings_dealloc(Holdings *self) {
    for (uint32_t p = 0; p < self->n_pages; p++) PyMem_Free(self->pages[p]);
    PyMem_Free(self->pages);
    for (int t = 0; t < N_TIERS; t++) {
        if (self->mask_pages[t] == NULL) continue;
        for (uint32_t p = 0; p < self->page_cap; p++) PyMem_Free(self->mask_pages[t][p]);
        PyMem_Free(self->mask_pages[t]);
    }
    PyMem_Free(self->table);
    PyMem_Free(self->counts);
    PyMem_Free(self->scratch);
    PyMem_Free(self->pool);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Holdings_init(Holdings *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n_slots", NULL};
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &n)) return -1;
    if (self->table != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "holdings are initialized once");
        return -1;
    }
    if (n <= 0) {
        PyErr_SetString(PyExc_ValueError, "an index needs at least one instance slot");
        return -1;
    }
    if (n > MAX_SPARSE_SLOTS) {
        PyErr_Format(PyExc_ValueError, "at most %zd instance slots", MAX_SPARSE_SLOTS);
        return -1;
    }
    self->n_slots = n;
    self->words = (n + 63) / 64;
    self->pool_free = NONE;
    self->page_cap = 4;
    self->pages = PyMem_Calloc(self->page_cap, sizeof(Entry *));
    self->table_cap = 1024;
    self->table = PyMem_Malloc(self->table_cap * sizeof(uint32_t));
    self->counts = PyMem_Calloc((size_t)N_TIERS * n, sizeof(int64_t));
    self->scratch = PyMem_Calloc((size_t)3 * self->words, sizeof(uint64_t));
    if (!self->pages || !self->table || !self->counts || !self->scratch) {
        PyErr_NoMemory();
        return -1;
    }
    memset(self->table, 0xff, self->table_cap * sizeof(uint32_t));
    self->free_head = NONE;
    return 0;
}

static PyObject *Holdings_holders(Holdings *self, PyObject *args) {
    PyObject *hobj;
    int tier = 0;
    if (!PyArg_ParseTuple(args, "O|i", &hobj, &tier)) return NULL;
    uint64_t h;
    if (check_slot_tier(self, 0, tier) < 0 || read_hash(hobj, &h) < 0) return NULL;
    uint32_t i = lookup(self, h);
    uint64_t *bits = self->scratch + 2 * self->words;
    h_expand(self, i == NONE ? 0 : holders_of(self, tier, i), bits);
    return bits_to_int(self, bits);
}

static PyObject *Holdings_count(Holdings *self, PyObject *args) {
    Py_ssize_t slot;
    int tier = 0;
    if (!PyArg_ParseTuple(args, "n|i", &slot, &tier)) return NULL;
    if (check_slot_tier(self, slot, tier) < 0) return NULL;
    return PyLong_FromLongLong(self->counts[tier * self->n_slots + slot]);
}

/* Every slot's count in `tier`, as a list in slot order (one call instead of one a slot). */
static PyObject *Holdings_counts(Holdings *self, PyObject *args) {
    int tier = 0;
    if (!PyArg_ParseTuple(args, "|i", &tier)) return NULL;
    if (check_slot_tier(self, 0, tier) < 0) return NULL;
    PyObject *out = PyList_New(self->n_slots);
    if (out == NULL) return NULL;
    for (Py_ssize_t s = 0; s < self->n_slots; s++) {
        PyObject *n = PyLong_FromLongLong(self->counts[tier * self->n_slots + s]);
        if (n == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, s, n);
    }
    return out;
}

static Py_ssize_t Holdings_len(Holdings *self) { return self->held; }

/* The holder word of hashes[k] in `tier` (0 when nobody holds it); sets *err on bad input. */
static uint64_t read_holders(Holdings *self, PyObject **items, Py_ssize_t k, int tier, int *err) {
    uint64_t h;
    if (read_hash(items[k], &h) < 0) { *err = 1; return 0; }
    uint32_t i = lookup(self, h);
    return i == NONE ? 0 : holders_of(self, tier, i);
}

static PyObject *Holdings_match(Holdings *self, PyObject *args) {
    PyObject *seq, *limit_obj = Py_None;
    int tier = 0;
    if (!PyArg_ParseTuple(args, "O|iO", &seq, &tier, &limit_obj)) return NULL;
    if (check_slot_tier(self, 0, tier) < 0) return NULL;
    Py_ssize_t limit = PY_SSIZE_T_MAX;
    if (limit_obj != Py_None) {
        limit = PyLong_AsSsize_t(limit_obj);
        if (limit == -1 && PyErr_Occurred()) return NULL;
        if (limit < 0) limit = 0;
    }
    PyObject *fast = PySequence_Fast(seq, "block hashes must be a sequence");
    if (fast == NULL) return NULL;
    PyObject *result = PyDict_New();
    if (result == NULL) { Py_DECREF(fast); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), words = self->words;
    if (n > limit) n = limit;  /* the first `limit` blocks only, without slicing a copy */
    PyObject **items = PySequence_Fast_ITEMS(fast);
    if (n == 0) { Py_DECREF(fast); return result; }
    uint64_t *alive = self->scratch, *nxt = self->scratch + words;
    int err = 0;
    uint64_t w = read_holders(self, items, 0, tier, &err);
    if (err) goto fail;
    h_expand(self, w, alive);
    Py_ssize_t pos = 0;  /* every slot in `alive` holds blocks [0, pos] */
    while (any_bits(alive, words)) {
        /* Gallop then bisect for the last position still held by all of `alive`. */
        Py_ssize_t lo = pos, step = 1, hi = n;
        while (lo + step < hi) {
            w = read_holders(self, items, lo + step, tier, &err);
            if (err) goto fail;
            if (h_covers(self, w, alive)) { lo += step; step <<= 1; }
            else { hi = lo + step; break; }
        }
        while (hi - lo > 1) {
            Py_ssize_t mid = (lo + hi) >> 1;
            w = read_holders(self, items, mid, tier, &err);
            if (err) goto fail;
            if (h_covers(self, w, alive)) lo = mid; else hi = mid;
        }
        if (lo + 1 < n) {
            w = read_holders(self, items, lo + 1, tier, &err);
            if (err) goto fail;
            h_and(self, w, alive, nxt);
        } else {
            memset(nxt, 0, words * sizeof(uint64_t));
        }
        PyObject *length = PyLong_FromSsize_t(lo + 1);
        if (length == NULL) goto fail;
        for (Py_ssize_t k = 0; k < words; k++) {
            uint64_t gone = alive[k] & ~nxt[k];
            while (gone) {
                int bit = __builtin_ctzll(gone);
                gone &= gone - 1;
                PyObject *slot = PyLong_FromSsize_t(k * 64 + bit);
                if (slot == NULL || PyDict_SetItem(result, slot, length) < 0) {
                    Py_XDECREF(slot); Py_DECREF(length); goto fail;
                }
                Py_DECREF(slot);
            }
        }
        Py_DECREF(length);
        memcpy(alive, nxt, words * sizeof(uint64_t));
        pos = lo + 1;
    }
    Py_DECREF(fast);
    return result;
fail:
    Py_DECREF(fast);
    Py_DECREF(result);
    return NULL;
}

/* `slot` now holds the chain hashes[0..n) in `tier`, the first continuing `parent` (when
 * has_parent); -1 if out of memory (with the Python error set). */
static int store_chain(Holdings *self, Py_ssize_t slot, int tier, int has_parent,
                       uint64_t parent, const uint64_t *hashes, Py_ssize_t n) {
    if (has_parent) {
        uint32_t p = lookup(self, parent);
        if (p == NONE || !h_has(self, holders_of(self, tier, p), slot)) self->unknown_parents++;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t h = hashes[k];
        /* Everything this block needs is allocated before anything about it changes. */
        uint32_t i = intern(self, h), p = NONE;
        if (i == NONE) goto fail;
        int first = !held_anywhere(self, i);
        if (first && has_parent) {
            p = intern(self, parent);
            if (p == NONE) { release_if_unused(self, i); goto fail; }
        }
        uint64_t *w = holder_word_for_write(self, tier, i);
        if (w == NULL || (sparse(self) && pool_reserve(self) < 0)) {
            release_if_unused(self, i);
            if (p != NONE) release_if_unused(self, p);
            goto fail;
        }
        if (first) {
            /* First holder anywhere: link it under its parent (the reference keeps the first
             * parent a block was stored with). */
            self->held++;
            if (p != NONE) {
                Entry *e = entry(self, i), *pe = entry(self, p);
                e->parent = p;
                e->next_sibling = pe->first_child;
                e->prev_sibling = NONE;
                if (pe->first_child != NONE) entry(self, pe->first_child)->prev_sibling = i;
                pe->first_child = i;
            }
        }
        if (h_has(self, *w, slot)) {
            self->duplicate_stores++;
        } else {
            h_add(self, w, slot);
            self->counts[tier * self->n_slots + slot]++;
        }
        parent = h;
        has_parent = 1;
    }
    return 0;
fail:
    return -1;
}

/* The parent argument: None, or a hash. Returns -1 on a bad one. */
static int read_parent(PyObject *pobj, int *has_parent, uint64_t *parent) {
    *parent = 0;
    *has_parent = pobj != Py_None;
    return *has_parent ? read_hash(pobj, parent) : 0;
}

static PyObject *Holdings_store(Holdings *self, PyObject *args) {
    Py_ssize_t slot;
    PyObject *seq, *pobj;
    int tier = 0, has_parent;
    uint64_t parent;
    if (!PyArg_ParseTuple(args, "nOO|i", &slot, &seq, &pobj, &tier)) return NULL;
    if (check_slot_tier(self, slot, tier) < 0) return NULL;
    if (read_parent(pobj, &has_parent, &parent) < 0) return NULL;
    Py_ssize_t n;
    uint64_t *hashes = read_hashes(seq, &n);  /* every hash read before anything changes */
    if (hashes == NULL) return NULL;
    int rc = store_chain(self, slot, tier, has_parent, parent, hashes, n);
    PyMem_Free(hashes);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* The hashes a bytes-like object packs (little-endian u64, 8 bytes each) as a C array
 * (caller frees): no Python int is made. NULL with ValueError unless its length is a whole
 * number of hashes. */
static uint64_t *read_packed(Py_buffer *buf, Py_ssize_t *n) {
    if (buf->len % 8) {
        PyErr_Format(PyExc_ValueError,
                     "%zd bytes are not a whole number of 8-byte little-endian u64 hashes",
                     buf->len);
        return NULL;
    }
    *n = buf->len / 8;
    uint64_t *out = PyMem_Malloc((*n ? *n : 1) * sizeof(uint64_t));
    if (out == NULL) { PyErr_NoMemory(); return NULL; }
    if (*n) memcpy(out, buf->buf, (size_t)buf->len);  /* also aligns them */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (Py_ssize_t k = 0; k < *n; k++) out[k] = __builtin_bswap64(out[k]);
#endif
    return out;
}

static PyObject *Holdings_store_packed(Holdings *self, PyObject *args) {
    Py_ssize_t slot;
    Py_buffer buf;
    PyObject *pobj;
    int tier = 0, has_parent;
    uint64_t parent;
    if (!PyArg_ParseTuple(args, "ny*O|i", &slot, &buf, &pobj, &tier)) return NULL;
    Py_ssize_t n;
    uint64_t *hashes = NULL;
    int rc = -1;
    if (check_slot_tier(self, slot, tier) == 0 && read_parent(pobj, &has_parent, &parent) == 0
        && (hashes = read_packed(&buf, &n)) != NULL)
        rc = store_chain(self, slot, tier, has_parent, parent, hashes, n);
    PyMem_Free(hashes);
    PyBuffer_Release(&buf);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* Drop `root` and its descendants held by `slot` in `tier` (the reference's _drop_subtree). */
static int drop_subtree(Holdings *self, Py_ssize_t slot, int tier, uint64_t root) {
    Py_ssize_t cap = 64, top = 0;
    uint64_t *stack = PyMem_Malloc(cap * sizeof(uint64_t));
    if (stack == NULL) { PyErr_NoMemory(); return -1; }
    stack[top++] = root;
    while (top) {
        uint64_t h = stack[--top];
        uint32_t i = lookup(self, h);
        if (i == NONE || !h_has(self, holders_of(self, tier, i), slot)) continue;
        if (h != root) self->cascaded_removals++;
        for (uint32_t c = entry(self, i)->first_child; c != NONE; c = entry(self, c)->next_sibling) {
            if (top == cap) {
                cap *= 2;
                uint64_t *grown = PyMem_Realloc(stack, cap * sizeof(uint64_t));
                if (grown == NULL) { PyMem_Free(stack); PyErr_NoMemory(); return -1; }
                stack = grown;
            }
            stack[top++] = entry(self, c)->hash;
        }
        unset(self, tier, slot, i);
    }
    PyMem_Free(stack);
    return 0;
}

/* `slot` no longer holds hashes[0..n) in `tier`, nor their descendants there; -1 if out of
 * memory (with the Python error set). */
static int remove_blocks(Holdings *self, Py_ssize_t slot, int tier, const uint64_t *hashes,
                         Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        uint32_t i = lookup(self, hashes[k]);
        if (i == NONE || !h_has(self, holders_of(self, tier, i), slot)) {
            self->absent_removals++;
        } else if (entry(self, i)->first_child != NONE) {
            if (drop_subtree(self, slot, tier, hashes[k]) < 0) return -1;
        } else {
            unset(self, tier, slot, i);
        }
    }
    return 0;
}

static PyObject *Holdings_remove(Holdings *self, PyObject *args) {
    Py_ssize_t slot;
    PyObject *seq;
    int tier = 0;
    if (!PyArg_ParseTuple(args, "nO|i", &slot, &seq, &tier)) return NULL;
    if (check_slot_tier(self, slot, tier) < 0) return NULL;
    Py_ssize_t n;
    uint64_t *hashes = read_hashes(seq, &n);
    if (hashes == NULL) return NULL;
    int rc = remove_blocks(self, slot, tier, hashes, n);
    PyMem_Free(hashes);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Holdings_remove_packed(Holdings *self, PyObject *args) {
    Py_ssize_t slot;
    Py_buffer buf;
    int tier = 0;
    if (!PyArg_ParseTuple(args, "ny*|i", &slot, &buf, &tier)) return NULL;
    Py_ssize_t n;
    uint64_t *hashes = NULL;
    int rc = -1;
    if (check_slot_tier(self, slot, tier) == 0 && (hashes = read_packed(&buf, &n)) != NULL)
        rc = remove_blocks(self, slot, tier, hashes, n);
    PyMem_Free(hashes);
    PyBuffer_Release(&buf);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Holdings_parent_of(Holdings *self, PyObject *arg) {
    uint64_t h;
    if (read_hash(arg, &h) < 0) return NULL;
    uint32_t i = lookup(self, h);
    if (i == NONE || entry(self, i)->parent == NONE) Py_RETURN_NONE;
    return hash_obj(entry(self, entry(self, i)->parent)->hash);
}

/* Hashes of every entry `slot` holds in `tier`, as a C array (caller frees). */
static uint64_t *held_by(Holdings *self, Py_ssize_t slot, int tier, Py_ssize_t *n) {
    int64_t count = self->counts[tier * self->n_slots + slot];
    uint64_t *out = PyMem_Malloc((count ? count : 1) * sizeof(uint64_t));
    if (out == NULL) { PyErr_NoMemory(); return NULL; }
    *n = 0;
    for (uint64_t b = 0; b < self->table_cap && *n < count; b++) {
        uint32_t i = self->table[b];
        if (i != NONE && h_has(self, holders_of(self, tier, i), slot)) out[(*n)++] = entry(self, i)->hash;
    }
    return out;
}

static PyObject *Holdings_blocks_of(Holdings *self, PyObject *args) {
    Py_ssize_t slot, n;
    int tier = 0;
    if (!PyArg_ParseTuple(args, "n|i", &slot, &tier)) return NULL;
    if (check_slot_tier(self, slot, tier) < 0) return NULL;
    uint64_t *hashes = held_by(self, slot, tier, &n);
    if (hashes == NULL) return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t k = 0; out != NULL && k < n; k++) {
        PyObject *h = hash_obj(hashes[k]);
        if (h == NULL) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, k, h);
    }
    PyMem_Free(hashes);
    return out;
}

static PyObject *Holdings_subtree_of(Holdings *self, PyObject *args) {
    Py_ssize_t slot, n;
    PyObject *seq;
    int tier = 0;
    if (!PyArg_ParseTuple(args, "nO|i", &slot, &seq, &tier)) return NULL;
    if (check_slot_tier(self, slot, tier) < 0) return NULL;
    uint64_t *roots = read_hashes(seq, &n);
    if (roots == NULL) return NULL;
    PyObject *out = PyList_New(0), *seen = PySet_New(NULL), *stack = PyList_New(0);
    if (out == NULL || seen == NULL || stack == NULL) goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        uint32_t i = lookup(self, roots[k]);
        if (i != NONE && h_has(self, holders_of(self, tier, i), slot)) {
            PyObject *h = hash_obj(roots[k]);
            if (h == NULL || PyList_Append(stack, h) < 0) { Py_XDECREF(h); goto fail; }
            Py_DECREF(h);
        }
    }
    while (PyList_GET_SIZE(stack)) {
        Py_ssize_t last = PyList_GET_SIZE(stack) - 1;
        PyObject *h = PyList_GET_ITEM(stack, last);
        Py_INCREF(h);
        if (PyList_SetSlice(stack, last, last + 1, NULL) < 0) { Py_DECREF(h); goto fail; }
        int was_seen = PySet_Contains(seen, h);
        if (was_seen) { Py_DECREF(h); if (was_seen < 0) goto fail; continue; }
        if (PySet_Add(seen, h) < 0 || PyList_Append(out, h) < 0) { Py_DECREF(h); goto fail; }
        uint64_t hv = PyLong_AsUnsignedLongLong(h);
        Py_DECREF(h);
        uint32_t i = lookup(self, hv);
        for (uint32_t c = entry(self, i)->first_child; c != NONE; c = entry(self, c)->next_sibling) {
            if (!h_has(self, holders_of(self, tier, c), slot)) continue;
            PyObject *ch = hash_obj(entry(self, c)->hash);
            if (ch == NULL || PyList_Append(stack, ch) < 0) { Py_XDECREF(ch); goto fail; }
            Py_DECREF(ch);
        }
    }
    PyMem_Free(roots);
    Py_DECREF(seen);
    Py_DECREF(stack);
    return out;
fail:
    PyMem_Free(roots);
    Py_XDECREF(out);
    Py_XDECREF(seen);
    Py_XDECREF(stack);
    return NULL;
}

static PyObject *Holdings_clear_slot(Holdings *self, PyObject *arg) {
    Py_ssize_t slot = PyLong_AsSsize_t(arg);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    if (check_slot_tier(self, slot, 0) < 0) return NULL;
    for (int tier = 0; tier < N_TIERS; tier++) {
        Py_ssize_t n;
        uint64_t *mine = held_by(self, slot, tier, &n);  /* rare: a full scan is fine */
        if (mine == NULL) return NULL;
        for (Py_ssize_t k = 0; k < n; k++) unset(self, tier, slot, lookup(self, mine[k]));
        PyMem_Free(mine);
    }
    Py_RETURN_NONE;
}

static PyObject *Holdings_counters(Holdings *self, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("KKKK", (unsigned long long)self->unknown_parents,
                         (unsigned long long)self->duplicate_stores,
                         (unsigned long long)self->absent_removals,
                         (unsigned long long)self->cascaded_removals);
}

static PyObject *Holdings_entries(Holdings *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(self->table_used);
}

static PyObject *Holdings_memory_bytes(Holdings *self, PyObject *Py_UNUSED(ignored)) {
    uint64_t total = self->table_cap * sizeof(uint32_t) + self->page_cap * sizeof(Entry *);
    total += (uint64_t)self->n_pages * PAGE_SIZE * sizeof(Entry);
    for (int t = 0; t < N_TIERS; t++) {
        if (self->mask_pages[t] == NULL) continue;
        total += self->page_cap * sizeof(uint64_t *);
        for (uint32_t p = 0; p < self->page_cap; p++)
            if (self->mask_pages[t][p]) total += (uint64_t)PAGE_SIZE * 8;
    }
    total += (uint64_t)self->pool_cap * self->words * 8;
    total += (uint64_t)N_TIERS * self->n_slots * sizeof(int64_t) + 3 * self->words * 8;
    return PyLong_FromUnsignedLongLong(total);
}

/* Everything, as plain dicts, for integrity checks: (masks per tier {hash: holders},
 * {held hash: parent hash or None}, {hash: [child hashes]}, counts per tier). */
static PyObject *Holdings_snapshot(Holdings *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *tiers = PyTuple_New(N_TIERS), *parents = PyDict_New(), *children = PyDict_New();
    PyObject *counts = PyTuple_New(N_TIERS);
    if (!tiers || !parents || !children || !counts) goto fail;
    for (int t = 0; t < N_TIERS; t++) {
        PyObject *d = PyDict_New(), *c = PyList_New(self->n_slots);
        if (d == NULL || c == NULL) { Py_XDECREF(d); Py_XDECREF(c); goto fail; }
        PyTuple_SET_ITEM(tiers, t, d);
        PyTuple_SET_ITEM(counts, t, c);
        for (Py_ssize_t s = 0; s < self->n_slots; s++)
            PyList_SET_ITEM(c, s, PyLong_FromLongLong(self->counts[t * self->n_slots + s]));
    }
    for (uint64_t b = 0; b < self->table_cap; b++) {
        uint32_t i = self->table[b];
        if (i == NONE) continue;
        Entry *e = entry(self, i);
        PyObject *h = hash_obj(e->hash);
        for (int t = 0; t < N_TIERS; t++) {
            uint64_t w = holders_of(self, t, i);
            if (w == 0) continue;
            h_expand(self, w, self->scratch);
            PyObject *v = bits_to_int(self, self->scratch);
            PyDict_SetItem(PyTuple_GET_ITEM(tiers, t), h, v);
            Py_DECREF(v);
        }
        if (held_anywhere(self, i)) {
            PyObject *p = e->parent == NONE ? Py_NewRef(Py_None) : hash_obj(entry(self, e->parent)->hash);
            PyDict_SetItem(parents, h, p);
            Py_DECREF(p);
        }
        if (e->first_child != NONE) {
            PyObject *kids = PyList_New(0);
            for (uint32_t c = e->first_child; c != NONE; c = entry(self, c)->next_sibling) {
                PyObject *ch = hash_obj(entry(self, c)->hash);
                PyList_Append(kids, ch);
                Py_DECREF(ch);
            }
            PyDict_SetItem(children, h, kids);
            Py_DECREF(kids);
        }
        Py_DECREF(h);
    }
    if (PyErr_Occurred()) goto fail;
    return Py_BuildValue("NNNN", tiers, parents, children, counts);
fail:
    Py_XDECREF(tiers); Py_XDECREF(parents); Py_XDECREF(children); Py_XDECREF(counts);
    return NULL;
}

static PyMethodDef Holdings_methods[] = {
    {"holders", (PyCFunction)Holdings_holders, METH_VARARGS, NULL},
    {"count", (PyCFunction)Holdings_count, METH_VARARGS, NULL},
    {"counts", (PyCFunction)Holdings_counts, METH_VARARGS, NULL},
    {"match", (PyCFunction)Holdings_match, METH_VARARGS, NULL},
    {"store", (PyCFunction)Holdings_store, METH_VARARGS, NULL},
    {"remove", (PyCFunction)Holdings_remove, METH_VARARGS, NULL},
    {"store_packed", (PyCFunction)Holdings_store_packed, METH_VARARGS, NULL},
    {"remove_packed", (PyCFunction)Holdings_remove_packed, METH_VARARGS, NULL},
    {"parent_of", (PyCFunction)Holdings_parent_of, METH_O, NULL},
    {"blocks_of", (PyCFunction)Holdings_blocks_of, METH_VARARGS, NULL},
    {"subtree_of", (PyCFunction)Holdings_subtree_of, METH_VARARGS, NULL},
    {"clear_slot", (PyCFunction)Holdings_clear_slot, METH_O, NULL},
    {"counters", (PyCFunction)Holdings_counters, METH_NOARGS, NULL},
    {"entries", (PyCFunction)Holdings_entries, METH_NOARGS, NULL},
    {"memory_bytes", (PyCFunction)Holdings_memory_bytes, METH_NOARGS, NULL},
    {"snapshot", (PyCFunction)Holdings_snapshot, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Holdings_as_sequence = {
    .sq_length = (lenfunc)Holdings_len,
};

static PyTypeObject HoldingsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsched.core._holdings.Holdings",
    .tp_doc = "Compiled block holdings (see kvsched.core.holdings for the reference).",
    .tp_basicsize = sizeof(Holdings),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Holdings_init,
    .tp_dealloc = (destructor)Holdings_dealloc,
    .tp_methods = Holdings_methods,
    .tp_as_sequence = &Holdings_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_holdings", "Compiled block holdings of the prefix index.", -1, NULL,
};

PyMODINIT_FUNC PyInit__holdings(void) {
    if (PyType_Ready(&HoldingsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Holdings", (PyObject *)&HoldingsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
