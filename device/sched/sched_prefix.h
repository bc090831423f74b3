// The prefix cache over the KV pages: a full page whose KV completed steps have written is kept
// under its key (ipc/prefix_keys.py: a hash chain over token ids) after its last holder lets
// go, so a later request whose prompt starts with the same tokens takes those pages instead of
// prefilling them.  The map lives here, in device memory, and only the scheduler touches it:
// the host computes each prompt's keys once, when it writes the request (they follow the prompt
// in the arena); matching, reference counts and eviction are decided between steps, and the
// critical phase reads no host memory for any of it.
//
//   prefix_table  key -> page, open addressing with linear probing; a cell is a page id,
//                 RL_CELL_EMPTY or RL_CELL_GONE (an evicted page's); rebuilt once gone cells
//                 fill a quarter of it, so at most 3/4 of it is ever taken
//   lru           the cached pages no slot holds, in the order they were let go (a ring;
//                 head: the least recently used, evicted first); a hit revives its page in
//                 place, leaving RL_CELL_GONE; compacted when half of the ring is in use
//   slot_keys     per slot, the keys of its full pages: the prompt's from the host, those of
//                 generated tokens computed here (rl_page_key, the host's function)
//
// Every page is exactly one of: held (ref_count > 0), free (free stack, uncached), cached and
// unheld (lru); a cached page is never written: a slot writes only positions past its match,
// into pages of its own, and only full pages whose KV is written are cached.
#pragma once

#define RL_NO_POS 0xFFFFFFFFu
#define RL_CELL_EMPTY 0xFFFFFFFFu
#define RL_CELL_GONE 0xFFFFFFFEu
#define RL_SH_LRU_HEAD 5

// ---- keys (the same function as ipc/prefix_keys.py) ---------------------------------------

RL_FN uint64_t rl_rotl64(uint64_t x, uint32_t b) {
  return (x << b) | (x >> (64u - b));
}

RL_FN void rl_sip_round(uint64_t& v0, uint64_t& v1, uint64_t& v2, uint64_t& v3) {
  v0 += v1;
  v1 = rl_rotl64(v1, 13) ^ v0;
  v0 = rl_rotl64(v0, 32);
  v2 += v3;
  v3 = rl_rotl64(v3, 16) ^ v2;
  v0 += v3;
  v3 = rl_rotl64(v3, 21) ^ v0;
  v2 += v1;
  v1 = rl_rotl64(v1, 17) ^ v2;
  v2 = rl_rotl64(v2, 32);
}

RL_FN uint64_t rl_mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The key of a full page of `tokens` (page_size ids) whose parent page's key is `parent` (0 for
// a first page): SipHash-1-3 of the tokens under the secret, chained through rl_mix64.
RL_FN uint64_t rl_page_key(const RlConfig& cfg, uint64_t parent, const int32_t* tokens) {
  uint64_t v0 = cfg.prefix_k0 ^ 0x736F6D6570736575ull, v1 = cfg.prefix_k1 ^ 0x646F72616E646F6Dull;
  uint64_t v2 = cfg.prefix_k0 ^ 0x6C7967656E657261ull, v3 = cfg.prefix_k1 ^ 0x7465646279746573ull;
  for (uint32_t i = 0; i < cfg.page_size; i += 2) {
    uint64_t hi = i + 1 < cfg.page_size ? (uint64_t)(uint32_t)tokens[i + 1] << 32 : 0ull;
    uint64_t m = (uint64_t)(uint32_t)tokens[i] | hi;
    v3 ^= m;
    rl_sip_round(v0, v1, v2, v3);
    v0 ^= m;
  }
  const uint64_t last = (uint64_t)((4u * cfg.page_size) & 0xFFu) << 56;
  v3 ^= last;
  rl_sip_round(v0, v1, v2, v3);
  v0 ^= last;
  v2 ^= 0xFFull;
  for (uint32_t r = 0; r < 3; ++r) rl_sip_round(v0, v1, v2, v3);
  return rl_mix64(parent ^ (v0 ^ v1 ^ v2 ^ v3));
}

// ---- the table -------------------------------------------------------------------------------

RL_FN uint32_t rl_table_home(const RlConfig& cfg, uint64_t key) {
  return (uint32_t)(key ^ (key >> 32)) & (cfg.table_size - 1u);
}

// The cached page under `key`, or RL_NO_POS.  Ends: the table always has empty cells.
RL_FN uint32_t rl_table_find(const RlContext& c, uint64_t key) {
  const uint32_t mask = c.cfg->table_size - 1u;
  for (uint32_t i = rl_table_home(*c.cfg, key);; i = (i + 1u) & mask) {
    uint32_t cell = c.prefix_table[i];
    if (cell == RL_CELL_EMPTY) return RL_NO_POS;
    if (cell != RL_CELL_GONE && c.pages[cell].key == key) return cell;
  }
}

// Caches `page` under `key`; with `unique`, not when the key is cached already (the page then
// stays private).  Threads insert at once through a compare-and-swap per cell; two inserting
// one key at once may both succeed: two pages of equal KV, each found or evicted on its own.
RL_FN void rl_table_insert(const RlContext& c, uint32_t page, uint64_t key, bool unique) {
  const uint32_t mask = c.cfg->table_size - 1u;
  c.pages[page].key = key;
  for (;;) {
    uint32_t at = RL_NO_POS, seen = RL_CELL_EMPTY;
    for (uint32_t i = rl_table_home(*c.cfg, key);; i = (i + 1u) & mask) {
      uint32_t cell = c.prefix_table[i];
      bool open = cell == RL_CELL_EMPTY || cell == RL_CELL_GONE;
      if (open && at == RL_NO_POS) {
        at = i;
        seen = cell;
      }
      if (cell == RL_CELL_EMPTY || (open && !unique)) break;
      if (!open && unique && c.pages[cell].key == key) return;
    }
    if (rl_atomic_cas(&c.prefix_table[at], seen, page) == seen) {
      c.pages[page].table_pos = at;
      return;
    }
  }
}

// Once gone cells fill a quarter of the table: empties it and inserts every cached page again.
// Between two calls at most n_pages pages are evicted, so live + gone stays under 3/4.
RL_FN void rl_rebuild_table_when_due(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  if (st.n_gone <= cfg.table_size / 4u) return;
  RL_FOR(i, cfg.table_size) c.prefix_table[i] = RL_CELL_EMPTY;
  RL_SYNC();
  RL_FOR(p, cfg.n_pages)
    if (c.pages[p].table_pos != RL_NO_POS) rl_table_insert(c, p, c.pages[p].key, false);
  RL_SYNC();
  if (RL_LEADER) st.n_gone = 0;
  RL_SYNC();
}

// ---- references, the lru ring and eviction ----------------------------------------------------

RL_FN void rl_lru_push(const RlContext& c, uint32_t page, uint32_t pos) {
  c.lru[pos & (c.cfg->lru_size - 1u)] = page;
  c.pages[page].lru_pos = pos;
}

// Drops slot s's reference to each of its pages, newest first; marks in its block table (as
// ~page) the pages it was the last holder of and counts them: uncached ones into to_free,
// cached ones into to_lru.  Slots may drop references to one page at once (atomic).
RL_FN void rl_unref_pages(const RlContext& c, const RlSlot& sl, uint32_t s, uint32_t& to_free,
                          uint32_t& to_lru) {
  int32_t* table = c.block_table + (size_t)s * c.cfg->pages_per_slot;
  for (uint32_t k = sl.n_pages; k-- > 0;) {
    uint32_t page = (uint32_t)table[k];
    if (rl_atomic_add(&c.pages[page].ref_count, 0xFFFFFFFFu) != 1u) continue;  // still held
    table[k] = ~(int32_t)page;
    if (c.pages[page].table_pos != RL_NO_POS)
      to_lru += 1;
    else
      to_free += 1;
  }
}

// Pushes the pages rl_unref_pages marked: uncached ones onto the free stack from free_at, cached
// ones onto the lru ring from lru_at, newest page first (a prefix's tail is evicted before its
// head, which more requests share).  The slot holds no page after.
RL_FN void rl_push_unheld(const RlContext& c, RlSlot& sl, uint32_t s, uint32_t free_at,
                          uint32_t lru_at) {
  const int32_t* table = c.block_table + (size_t)s * c.cfg->pages_per_slot;
  for (uint32_t k = sl.n_pages; k-- > 0;) {
    if (table[k] >= 0) continue;
    uint32_t page = (uint32_t)~table[k];
    if (c.pages[page].table_pos != RL_NO_POS)
      rl_lru_push(c, page, lru_at++);
    else
      c.free_pages[free_at++] = page;
  }
  sl.n_pages = 0;
}

// Leader only: slot s lets go of all its pages (a preemption; releases of many slots at once
// are rl_release_pages').
RL_FN void rl_release_slot_serial(const RlContext& c, RlSlot& sl, uint32_t s) {
  RlSchedState& st = *c.sched;
  uint32_t to_free = 0, to_lru = 0;
  rl_unref_pages(c, sl, s, to_free, to_lru);
  rl_push_unheld(c, sl, s, st.n_free_pages, st.lru_tail);
  st.n_free_pages += to_free;
  st.lru_tail += to_lru;
  st.n_cached_free += to_lru;
}

// Evicts cached pages no slot holds, least recently used first, onto the free stack (their keys
// leave the table) until `wanted` pages are free or none is left to evict.
RL_FN void rl_evict_for(const RlContext& c, RlShared* sh, uint32_t wanted) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  const uint32_t mask = cfg.lru_size - 1u;
  uint32_t need = wanted > st.n_free_pages ? wanted - st.n_free_pages : 0u;
  if (need > st.n_cached_free) need = st.n_cached_free;
  uint32_t* rank = c.work_f;  // per ring entry of the window: its rank among live entries
  while (need > 0) {
    const uint32_t base = st.lru_head;
    const uint32_t m = st.lru_tail - base < cfg.work_len ? st.lru_tail - base : cfg.work_len;
    RL_FOR(i, m) rank[i] = c.lru[(base + i) & mask] != RL_CELL_GONE ? 1u : 0u;
    RL_SYNC();
    const uint32_t live = rl_exclusive_scan(rank, m, sh);
    const uint32_t take = live < need ? live : need, top = st.n_free_pages;
    if (RL_LEADER && take == live) sh->u[RL_SH_LRU_HEAD] = base + m;
    RL_FOR(i, m) {
      uint32_t page = c.lru[(base + i) & mask];
      if (page == RL_CELL_GONE) continue;
      if (rank[i] < take) {
        RlPage& pg = c.pages[page];
        c.prefix_table[pg.table_pos] = RL_CELL_GONE;
        pg.table_pos = RL_NO_POS;
        pg.lru_pos = RL_NO_POS;
        c.lru[(base + i) & mask] = RL_CELL_GONE;
        c.free_pages[top + rank[i]] = page;
      } else if (rank[i] == take) {
        sh->u[RL_SH_LRU_HEAD] = base + i;  // the first page kept
      }
    }
    RL_SYNC();
    if (RL_LEADER) {
      st.lru_head = sh->u[RL_SH_LRU_HEAD];
      st.n_free_pages = top + take;
      st.n_cached_free -= take;
      st.n_gone += take;
    }
    RL_SYNC();
    need -= take;
  }
}

// Once the ring's window [lru_head, lru_tail) is over half of it: rewrites its live entries, in
// order, after the tail.  Live entries are at most n_pages (a quarter of the ring) and a cycle of
// the scheduler pushes each page at most once, so the window never reaches the ring's size.
RL_FN void rl_compact_lru_when_due(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  const uint32_t mask = cfg.lru_size - 1u, tail = st.lru_tail;
  if (tail - st.lru_head <= cfg.lru_size / 2u) return;
  uint32_t* rank = c.work_f;
  uint32_t written = 0;
  for (uint32_t base = st.lru_head; base != tail;) {
    const uint32_t m = tail - base < cfg.work_len ? tail - base : cfg.work_len;
    RL_FOR(i, m) rank[i] = c.lru[(base + i) & mask] != RL_CELL_GONE ? 1u : 0u;
    RL_SYNC();
    const uint32_t live = rl_exclusive_scan(rank, m, sh);
    RL_FOR(i, m) {
      uint32_t page = c.lru[(base + i) & mask];
      if (page != RL_CELL_GONE) rl_lru_push(c, page, tail + written + rank[i]);
    }
    RL_SYNC();
    written += live;
    base += m;
  }
  if (RL_LEADER) {
    st.lru_head = tail;
    st.lru_tail = tail + written;
  }
  RL_SYNC();
}

// ---- caching written pages -------------------------------------------------------------------

// Overlapped: caches each running or ending slot's full pages whose KV completed steps have
// written (kv_done), keying those of generated tokens here (the prompt's keys came from the
// host).  An aborted slot caches nothing more.
RL_FN void rl_cache_written_pages(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  if (!cfg.prefix_caching) return;
  rl_rebuild_table_when_due(c, sh);
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    if (!rl_slot_runs(sl) && sl.state != RL_SLOT_ENDING) continue;
    uint32_t full = sl.kv_done / cfg.page_size;
    if (full > sl.n_pages) full = sl.n_pages;
    uint64_t* keys = c.slot_keys + (size_t)s * cfg.pages_per_slot;
    const int32_t* table = c.block_table + (size_t)s * cfg.pages_per_slot;
    for (uint32_t j = sl.n_cached; j < full; ++j) {
      if (j == sl.n_keyed) {
        keys[j] = rl_page_key(cfg, j ? keys[j - 1] : 0ull,
                              rl_slot_tokens(c, s) + (size_t)j * cfg.page_size);
        sl.n_keyed = j + 1;
      }
      rl_table_insert(c, (uint32_t)table[j], keys[j], true);
    }
    if (full > sl.n_cached) sl.n_cached = full;
  }
  RL_SYNC();
}

// ---- matching at admission -------------------------------------------------------------------

// Candidates k < n, bound for slot slot_of[k] whose slot_keys row holds their keys, look up
// their first cap[k] pages (every (candidate, page) pair at once); the pages found go into the
// slot's block table; cap[k] becomes the count matched (the leading pages found, never the
// last token's page: its row must run to sample), and cost[k], the pages the candidate would
// take, drops by the matched pages and rises by those of them no slot holds (they stop being
// evictable).
RL_FN void rl_lookup_prefixes(const RlContext& c, RlShared* sh, const uint32_t* slot_of, uint32_t n,
                              uint32_t* cap, uint32_t* cost) {
  const RlConfig& cfg = *c.cfg;
  uint32_t* start = c.work_f;
  RL_FOR(k, n) start[k] = cap[k];
  RL_SYNC();
  const uint32_t total = rl_exclusive_scan(start, n, sh);
  RL_FOR(i, total) {
    uint32_t k = rl_owner_of(start, n, i), j = i - start[k];
    size_t row = (size_t)slot_of[k] * cfg.pages_per_slot;
    uint32_t page = rl_table_find(c, c.slot_keys[row + j]);
    c.block_table[row + j] = page == RL_NO_POS ? -1 : (int32_t)page;
  }
  RL_SYNC();
  RL_FOR(k, n) {
    const int32_t* table = c.block_table + (size_t)slot_of[k] * cfg.pages_per_slot;
    uint32_t m = 0, unheld = 0;
    while (m < cap[k] && table[m] >= 0) unheld += c.pages[table[m++]].ref_count == 0u;
    cap[k] = m;
    cost[k] = cost[k] - m + unheld;
  }
  RL_SYNC();
}

// The admitted candidates k < n take their matched pages (matched[k], already in their slots'
// block tables; a page no slot held leaves the lru ring) and the free pages they still need
// (fresh[k]; turned into offsets), evicting for them when the free stack is short.  Returns
// where on the free stack their fresh pages start; the caller takes them and sets
// n_free_pages to it.
RL_FN uint32_t rl_claim_pages(const RlContext& c, RlShared* sh, const uint32_t* slot_of, uint32_t n,
                              const uint32_t* matched, uint32_t* fresh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  if (cfg.prefix_caching) {
    uint32_t* start = c.work_f;
    RL_FOR(k, n) start[k] = matched[k];
    RL_SYNC();
    const uint32_t total = rl_exclusive_scan(start, n, sh);
    uint32_t my_revived = 0;
    RL_FOR(i, total) {
      uint32_t k = rl_owner_of(start, n, i), j = i - start[k];
      uint32_t page = (uint32_t)c.block_table[(size_t)slot_of[k] * cfg.pages_per_slot + j];
      if (rl_atomic_add(&c.pages[page].ref_count, 1u) == 0u) {  // was in the lru ring
        c.lru[c.pages[page].lru_pos & (cfg.lru_size - 1u)] = RL_CELL_GONE;
        c.pages[page].lru_pos = RL_NO_POS;
        my_revived += 1;
      }
    }
    const uint32_t revived = rl_block_sum(my_revived, sh);
    if (RL_LEADER) st.n_cached_free -= revived;
    RL_SYNC();
  }
  RL_SYNC();
  const uint32_t total_fresh = rl_exclusive_scan(fresh, n, sh);
  rl_evict_for(c, sh, total_fresh);
  return st.n_free_pages - total_fresh;
}
