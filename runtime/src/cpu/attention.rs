//! Attention over the paged KV cache on the CPU: one task per (a few consecutive query rows of
//! a sequence, query heads of one KV head) across every sequence of the step, f32 softmax with
//! the maximum subtracted. Each row's results are computed as if it were alone (the same
//! arithmetic whatever else is in the step or its task), so a batched step gives every
//! sequence bit-identical results to running it by itself. Tested against the IR reference.

use super::activation;
use super::kv_element::KvElement;
use super::kv_pages::{LayerPages, PagesOf, TypedPages};
use super::pool;
use super::simd;
use crate::kv::BlockId;
use ir::reference::ops::attends;
use ir::AttentionSpec;
use std::ops::Range;

/// A query row of the step: its position, and the block table of its sequence, whose cache
/// already holds the keys and values of every position up to and including `pos`.
#[derive(Debug, Clone, Copy)]
pub struct QueryRow<'a> {
    pub pos: usize,
    pub table: &'a [BlockId],
}

/// The most query rows a task takes: consecutive rows of one sequence (a prompt chunk's), so
/// each cache row it reads serves every one of them.
const TILE_ROWS: usize = 4;

/// `q` is `[rows.len(), heads·hd]`; writes `[rows.len(), heads·hd]` into `out`.
///
/// A task takes up to [`TILE_ROWS`] consecutive query rows of one sequence and up to
/// [`simd::MANY`] query heads of one KV head, so each cache row it reads serves all of them;
/// where that would leave fewer tasks than the pool has threads to keep busy (decode of a few
/// sequences), a task takes one row and one head. Either way each (row, head)'s scores,
/// softmax and weighted sum are the one-row, one-head operations, bit for bit, over the cache
/// rows widened from whatever element type they are stored in.
pub fn attention(spec: &AttentionSpec, q: &[f32], rows: &[QueryRow], kv: &LayerPages, out: &mut [f32]) {
    let block_size = kv.block_size();
    match kv.typed() {
        PagesOf::F32(pages) => attention_over(spec, q, rows, &Cache { pages, block_size }, out),
        PagesOf::Bf16(pages) => attention_over(spec, q, rows, &Cache { pages, block_size }, out),
        PagesOf::F16(pages) => attention_over(spec, q, rows, &Cache { pages, block_size }, out),
        PagesOf::F8(pages) => attention_over(spec, q, rows, &Cache { pages, block_size }, out),
    }
}

/// A slot's rows of element type `T`, and its block size.
struct Cache<'a, T> {
    pages: TypedPages<'a, T>,
    block_size: usize,
}

fn attention_over<T: KvElement>(spec: &AttentionSpec, q: &[f32], rows: &[QueryRow], kv: &Cache<T>, out: &mut [f32]) {
    let group = spec.heads / spec.kv_heads;
    let shared = (1..=simd::MANY.min(group))
        .rev()
        .find(|g| group.is_multiple_of(*g))
        .unwrap_or(1);
    let busy = |tasks: usize| tasks >= 2 * pool::global().threads();
    // Tiles of several rows only where 512-bit registers hold their weighted sums.
    let tiles = row_tiles(rows, TILE_ROWS);
    let tiled = simd::wide_many(spec.head_dim) && tiles.len() < rows.len() && busy(tiles.len() * spec.heads / shared);
    if tiled {
        return match shared {
            4 => attend::<4, 4, 16, T>(spec, q, rows, &tiles, kv, out),
            3 => attend::<3, 4, 12, T>(spec, q, rows, &tiles, kv, out),
            2 => attend::<2, 4, 8, T>(spec, q, rows, &tiles, kv, out),
            _ => attend::<1, 4, 4, T>(spec, q, rows, &tiles, kv, out),
        };
    }
    let longest = rows
        .iter()
        .map(|r| r.pos + 1 - window_start(spec, r.pos))
        .max()
        .unwrap_or(0);
    if T::COSTLY_WIDENING && !busy(rows.len() * spec.heads / shared) && longest >= SPLIT_FROM_POSITIONS {
        return match shared {
            4 => attend_split::<4, T>(spec, q, rows, kv, out),
            3 => attend_split::<3, T>(spec, q, rows, kv, out),
            2 => attend_split::<2, T>(spec, q, rows, kv, out),
            _ => attend_split::<1, T>(spec, q, rows, kv, out),
        };
    }
    let single = row_tiles(rows, 1);
    match if busy(rows.len() * spec.heads / shared) {
        shared
    } else {
        1
    } {
        4 => attend::<4, 1, 4, T>(spec, q, rows, &single, kv, out),
        3 => attend::<3, 1, 3, T>(spec, q, rows, &single, kv, out),
        2 => attend::<2, 1, 2, T>(spec, q, rows, &single, kv, out),
        _ => attend::<1, 1, 1, T>(spec, q, rows, &single, kv, out),
    }
}

/// The first position a query at `pos` sees.
fn window_start(spec: &AttentionSpec, pos: usize) -> usize {
    spec.window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// Positions from which a step of few query rows (decode) over a cache whose widening is
/// costly (FP8) splits attention three ways instead of a task a (row, head): a task a (row,
/// query heads of one KV head) would leave threads idle, and a head a task widens every cache
/// row once per query head. (Over f32, bf16 and half caches the split measured no faster: at
/// 2048 positions, batch 1, 11.5–12.1 ms a step unsplit, 12.6–12.7 split; FP8 31.1 → 17.0.)
const SPLIT_FROM_POSITIONS: usize = 256;

/// Positions a scoring task of [`attend_split`] takes.
const SCORE_CHUNK: usize = 128;

/// Columns of the head a weighted-sum task of [`attend_split`] takes (a 512-bit register's).
const SUM_COLUMNS: usize = 16;

/// [`attention`] for a few rows over many positions, in three jobs whose tasks all read each
/// cache row once for the `G` query heads of its KV head: the scores by chunks of positions
/// (each score is its own dot), the softmax by (row, head), the weighted sums by chunks of the
/// head's columns (each column's sum runs over the positions in order on its own). Every
/// number is computed by the operation the one-row, one-head form uses on the same operands,
/// so the results are its bits.
fn attend_split<const G: usize, T: KvElement>(
    spec: &AttentionSpec,
    q: &[f32],
    rows: &[QueryRow],
    kv: &Cache<T>,
    out: &mut [f32],
) {
    let (hd, heads) = (spec.head_dim, spec.heads);
    let (group, q_dim, block_size) = (heads / spec.kv_heads, heads * hd, kv.block_size);
    let scale = spec.scale as f32;
    assert_eq!(out.len(), rows.len() * q_dim);
    let seen: Vec<Range<usize>> = rows.iter().map(|r| window_start(spec, r.pos)..r.pos + 1).collect();
    // Row `r`'s head `h` scores its positions at `first_score[r] + h · seen[r].len()`.
    let first_score: Vec<usize> = seen
        .iter()
        .scan(0, |at, s| Some(std::mem::replace(at, *at + heads * s.len())))
        .collect();
    let mut scores = vec![0f32; seen.iter().map(|s| heads * s.len()).sum()];
    let score_at = |r: usize, head: usize| first_score[r] + head * seen[r].len();
    let kv_cols = |head: usize| (head / group) * hd..(head / group + 1) * hd;
    let query = |r: usize, head: usize| &q[r * q_dim + head * hd..r * q_dim + (head + 1) * hd];
    let pool = pool::global();
    // Scores: a task a (row, heads `first..first + G`, chunk of its positions).
    let score_tasks: Vec<(usize, usize, Range<usize>)> = (0..rows.len())
        .flat_map(|r| (0..heads).step_by(G).map(move |first| (r, first)))
        .flat_map(|(r, first)| {
            let s = seen[r].clone();
            (s.start..s.end)
                .step_by(SCORE_CHUNK)
                .map(move |p| (r, first, p..(p + SCORE_CHUNK).min(s.end)))
        })
        .collect();
    let scores_out = TaskOutputs(scores.as_mut_ptr());
    pool.for_each(score_tasks.len(), Vec::<&[T]>::new, |cached, t| {
        let (r, first, ref positions) = score_tasks[t];
        cached.clear();
        kv.pages
            .keys_into(rows[r].table, block_size, positions.clone(), kv_cols(first), cached);
        let queries: [&[f32]; G] = std::array::from_fn(|g| query(r, first + g));
        let at = |g: usize| score_at(r, first + g) + positions.start - seen[r].start;
        // SAFETY: each task's (row, head, positions) scores are its own, inside `scores`.
        let mut outs: [&mut [f32]; G] = std::array::from_fn(|g| unsafe { scores_out.slice(at(g), positions.len()) });
        simd::dots_many(&queries, cached, &mut outs);
    });
    pool.for_each(
        rows.len() * heads,
        || (),
        |_, t| {
            let (r, head) = (t / heads, t % heads);
            // SAFETY: each (row, head)'s scores are one task's; the scoring job has finished.
            softmax(unsafe { scores_out.slice(score_at(r, head), seen[r].len()) }, scale);
        },
    );
    let scores = &scores;
    // Weighted sums: a task a (row, heads `first..first + G`, chunk of the head's columns).
    let column_chunks = hd.div_ceil(SUM_COLUMNS);
    let sums_out = TaskOutputs(out.as_mut_ptr());
    pool.for_each(rows.len() * heads / G * column_chunks, Vec::<&[T]>::new, |cached, t| {
        let (r, first, chunk) = (
            t / (heads / G * column_chunks),
            t / column_chunks % (heads / G) * G,
            t % column_chunks,
        );
        let columns = chunk * SUM_COLUMNS..((chunk + 1) * SUM_COLUMNS).min(hd);
        let values = kv_cols(first).start + columns.start..kv_cols(first).start + columns.end;
        cached.clear();
        kv.pages
            .values_into(rows[r].table, block_size, seen[r].clone(), values, cached);
        let weights: [&[f32]; G] = std::array::from_fn(|g| &scores[score_at(r, first + g)..][..seen[r].len()]);
        let at = |g: usize| r * q_dim + (first + g) * hd + columns.start;
        // SAFETY: each task's (row, head, columns) outputs are its own, inside `out`.
        let mut sums: [&mut [f32]; G] = std::array::from_fn(|g| unsafe { sums_out.slice(at(g), columns.len()) });
        sums.iter_mut().for_each(|s| s.fill(0.0));
        simd::axpys_many(&weights, cached, &mut sums);
    });
}

/// `rows` cut into runs of at most `most` consecutive positions of one sequence.
fn row_tiles(rows: &[QueryRow], most: usize) -> Vec<Range<usize>> {
    let mut tiles: Vec<Range<usize>> = Vec::new();
    for (t, row) in rows.iter().enumerate() {
        match tiles.last_mut() {
            Some(tile)
                if tile.len() < most && {
                    let last = rows[t - 1];
                    std::ptr::eq(last.table, row.table) && last.pos + 1 == row.pos
                } =>
            {
                tile.end = t + 1
            }
            _ => tiles.push(t..t + 1),
        }
    }
    tiles
}

/// [`attention`] with tasks of `G` query heads (of one KV head) of each of a tile's rows, `R`
/// rows at most: `N = G·R` queries (a shorter tile's spare places keep zero weights, and their
/// sums are dropped). Scores are taken a row at a time (its `G` heads' dots over its own
/// positions: sixteen products a reduction, where a tile's `N` would waste some), the weighted
/// sums for the whole tile where its rows see the same positions.
fn attend<const G: usize, const R: usize, const N: usize, T: KvElement>(
    spec: &AttentionSpec,
    q: &[f32],
    rows: &[QueryRow],
    tiles: &[Range<usize>],
    kv: &Cache<T>,
    out: &mut [f32],
) {
    let hd = spec.head_dim;
    let group = spec.heads / spec.kv_heads;
    let q_dim = spec.heads * hd;
    let scale = spec.scale as f32;
    let block_size = kv.block_size;
    assert_eq!(N, G * R, "a task's queries are its heads of its rows");
    let tasks_a_tile = spec.heads / G;
    assert_eq!(out.len(), rows.len() * q_dim);
    let out = TaskOutputs(out.as_mut_ptr());
    pool::global().for_each(
        tiles.len() * tasks_a_tile,
        || (Vec::<f32>::new(), Vec::<&[T]>::new(), Vec::<f32>::new()),
        |(scores, cached, results), task| {
            let (tile, first_head) = (tiles[task / tasks_a_tile].clone(), task % tasks_a_tile * G);
            let (first, last) = (rows[tile.start], rows[tile.end - 1]);
            let kv_cols = (first_head / group) * hd..(first_head / group + 1) * hd;
            // Query `n = i·G + g` is head `first_head + g` of the tile's row `i`.
            let query = |i: usize, g: usize| {
                let at = (tile.start + i) * q_dim + (first_head + g) * hd;
                &q[at..at + hd]
            };
            // Every position some row of the tile sees, and each row's own of them.
            let lo = window_start(spec, first.pos);
            let len = last.pos + 1 - lo;
            // (Empty for a short tile's spare rows.)
            let own: [Range<usize>; R] = std::array::from_fn(|i| match rows[tile.clone()].get(i) {
                Some(&QueryRow { pos, .. }) => {
                    debug_assert!((window_start(spec, pos)..=pos).all(|j| attends(pos, j, spec.window)));
                    window_start(spec, pos) - lo..pos + 1 - lo
                }
                None => 0..0,
            });
            // Scores and the weighted sum a batch of cache rows at a time (`simd::dots_many`,
            // `simd::axpys_many`): bit for bit the one-row, one-head forms. Positions a row does
            // not see keep a zero score, which no sum of its reads.
            cached.clear();
            kv.pages
                .keys_into(first.table, block_size, lo..lo + len, kv_cols.clone(), cached);
            scores.clear();
            scores.resize(N * len, 0.0);
            let mut query_scores: [&mut [f32]; N] = split(scores, len);
            let queries_kept = tile.len() * G;
            for (i, row_scores) in query_scores.chunks_mut(G).take(tile.len()).enumerate() {
                let own = own[i].clone();
                let queries: [&[f32]; G] = std::array::from_fn(|g| query(i, g));
                let mut own_scores: [&mut [f32]; G] = std::array::from_fn(|_| &mut [][..]);
                for (own_scores, scores) in own_scores.iter_mut().zip(row_scores.iter_mut()) {
                    *own_scores = &mut scores[own.clone()];
                }
                simd::dots_many(&queries, &cached[own], &mut own_scores);
                for scores in own_scores {
                    softmax(scores, scale);
                }
            }
            cached.clear();
            kv.pages
                .values_into(first.table, block_size, lo..lo + len, kv_cols.clone(), cached);
            results.clear();
            results.resize(N * hd, 0.0);
            let weights: [&[f32]; N] = query_scores.map(|s| &*s);
            let mut sums: [&mut [f32]; N] = split(results, hd);
            // Each sum adds its row's positions in order: those before the positions every row
            // sees alone, those jointly, those after alone.
            let common = own[tile.len() - 1].start..own[0].end;
            let joint = common.start < common.end;
            for (n, sum) in sums.iter_mut().enumerate().take(queries_kept) {
                let own = &own[n / G];
                let before = own.start..if joint { common.start } else { own.end };
                simd::axpys(&weights[n][before.clone()], &cached[before], sum);
            }
            if joint {
                let shared_weights: [&[f32]; N] = weights.map(|w| &w[common.clone()]);
                simd::axpys_many(&shared_weights, &cached[common.clone()], &mut sums);
                for (n, sum) in sums.iter_mut().enumerate().take(queries_kept) {
                    let after = common.end..own[n / G].end;
                    simd::axpys(&weights[n][after.clone()], &cached[after], sum);
                }
            }
            for i in 0..tile.len() {
                let at = (tile.start + i) * q_dim + first_head * hd;
                // SAFETY: the row's heads `first_head .. first_head + G` are inside `out`
                // (asserted above) and no other task writes them: tasks split the rows by tile
                // and a tile's heads by groups of `G`; `out` outlives the parallel loop.
                unsafe { out.write(at, &results[i * G * hd..(i + 1) * G * hd]) };
            }
        },
    );
}

/// `attention`'s output, written by its tasks at disjoint (row, head) places.
#[derive(Clone, Copy)]
struct TaskOutputs(*mut f32);

impl TaskOutputs {
    /// # Safety
    /// `at..at + values.len()` is inside the output, and no other task writes it.
    unsafe fn write(&self, at: usize, values: &[f32]) {
        // SAFETY: as the caller promises; `values` is the task's own memory.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), self.0.add(at), values.len()) };
    }

    /// Elements `at..at + len`, for one task.
    ///
    /// # Safety
    /// They are inside the output, and no other task touches them while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [f32] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

// SAFETY: tasks write disjoint places (see `TaskOutputs::write`), and the borrow it comes from
// outlives them (`attend` returns only after every task has finished).
unsafe impl Send for TaskOutputs {}
unsafe impl Sync for TaskOutputs {}

/// `v` as `G` consecutive slices of `len`.
fn split<const G: usize>(v: &mut [f32], len: usize) -> [&mut [f32]; G] {
    let mut rest = Some(v);
    std::array::from_fn(|_| {
        let (head, tail) = rest.take().expect("G slices").split_at_mut(len);
        rest = Some(tail);
        head
    })
}

simd::widest_vectors! {
    /// Scaled scores to probabilities: f32 softmax with the maximum subtracted, `e^x` by
    /// [`activation::exp`] (libm's `expf`, a call a score, took a seventh of a 512-token prefill)
    /// and the sum over sixteen lanes reduced pairwise as `simd::dot` sums; with AVX-512 or AVX2
    /// where the CPU has them, so the loops run 16 or 8 lanes wide (the same operations, so the
    /// same bits).
    fn softmax(scores: &mut [f32], scale: f32) => softmax_body
}

/// Lanes of a softmax's maximum and sum: element `i` goes to lane `i % LANES`.
const LANES: usize = 16;

#[inline(always)]
fn softmax_body(scores: &mut [f32], scale: f32) {
    let mut max = [f32::NEG_INFINITY; LANES];
    for_lanes(scores, |lane, s| {
        *s *= scale;
        max[lane] = max[lane].max(*s);
    });
    let max = max.into_iter().fold(f32::NEG_INFINITY, f32::max);
    let mut total = [0f32; LANES];
    for_lanes(scores, |lane, s| {
        *s = activation::exp(*s - max);
        total[lane] += *s;
    });
    let total = simd::reduce(total);
    scores.iter_mut().for_each(|p| *p /= total);
}

/// `f(i % LANES, &mut v[i])` for each element in order, whole chunks of `LANES` first so the
/// lane is a constant the compiler can vectorise over.
#[inline(always)]
fn for_lanes(v: &mut [f32], mut f: impl FnMut(usize, &mut f32)) {
    let mut chunks = v.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (lane, x) in chunk.iter_mut().enumerate() {
            f(lane, x);
        }
    }
    for (lane, x) in chunks.into_remainder().iter_mut().enumerate() {
        f(lane, x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::reference::{attention_over_slot, KvSlot};
    use ir::Tensor;

    type Attend = fn(&AttentionSpec, &[f32], &[QueryRow], &[Range<usize>], &Cache<f32>, &mut [f32]);
    type AttendSplit<T> = fn(&AttentionSpec, &[f32], &[QueryRow], &Cache<T>, &mut [f32]);

    /// An f32 slot of `kv_dim`-wide keys and values in blocks of 2 positions.
    fn f32_pages(kv_dim: usize) -> super::super::KvPages {
        let layout = super::super::KvLayout {
            dim: kv_dim,
            v_dim: kv_dim,
            dtype: ir::DType::F32,
        };
        super::super::KvPages::new(&[layout], &[], 2)
    }

    fn f32_cache(layer: &LayerPages) -> Cache<'_, f32> {
        match layer.typed() {
            PagesOf::F32(pages) => Cache { pages, block_size: 2 },
            _ => panic!("an f32 slot"),
        }
    }

    /// Tasks of one, two or four query heads, of one row or tiles of rows, give every head the
    /// same bits.
    #[test]
    fn heads_sharing_a_task_get_their_one_head_results() {
        let spec = AttentionSpec {
            heads: 8,
            kv_heads: 2,
            head_dim: 40,
            scale: 0.2,
            window: None,
            cache_slot: 0,
            cache_dtype: ir::DType::F32,
        };
        let (len, tokens, kv_dim) = (11, 3, 80);
        let val = |i: usize, m: usize| ((i * m % 29) as f32 - 14.0) / 9.0;
        let k: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 7)).collect();
        let v: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 5)).collect();
        let table = [2, 0, 5, 1, 4, 3].map(BlockId);
        let mut pages = f32_pages(kv_dim);
        pages.layer_mut(0).write(&table, 0, &k, &v);
        let q: Vec<f32> = (0..tokens * 320).map(|i| val(i, 3)).collect();
        let rows: Vec<QueryRow> = (len - tokens..len).map(|pos| QueryRow { pos, table: &table }).collect();
        let run = |attend: Attend, tile_rows: usize| {
            let mut out = vec![f32::NAN; tokens * 320];
            attend(
                &spec,
                &q,
                &rows,
                &row_tiles(&rows, tile_rows),
                &f32_cache(pages.layer(0)),
                &mut out,
            );
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let one = run(attend::<1, 1, 1, f32>, 1);
        assert_eq!(run(attend::<2, 1, 2, f32>, 1), one);
        assert_eq!(run(attend::<4, 1, 4, f32>, 1), one);
        assert_eq!(
            run(attend::<1, 4, 4, f32>, 4),
            one,
            "one head, tiles of up to four rows"
        );
        assert_eq!(run(attend::<2, 4, 8, f32>, 4), one, "two heads");
        assert_eq!(run(attend::<4, 4, 16, f32>, 4), one, "four heads");
    }

    /// Few rows over many positions split three ways (scores by chunks of positions, sums
    /// by chunks of columns, a last column chunk short), with and without a window, over f32
    /// and FP8 caches, give the one-row, one-head results; so does `attention` for one row
    /// (the split path over FP8 caches, the unsplit one otherwise).
    #[test]
    fn split_attention_gets_the_one_row_one_head_results() {
        let (len, kv_dim) = (2 * SCORE_CHUNK + 37, 80);
        let val = |i: usize, m: usize| ((i * m % 29) as f32 - 14.0) / 9.0;
        let k: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 7)).collect();
        let v: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 5)).collect();
        let table: Vec<BlockId> = (0..len.div_ceil(2) as u32).rev().map(BlockId).collect();
        let pages_of = |dtype| {
            let layout = super::super::KvLayout {
                dim: kv_dim,
                v_dim: kv_dim,
                dtype,
            };
            let mut pages = super::super::KvPages::new(&[layout], &[], 2);
            pages.layer_mut(0).write(&table, 0, &k, &v);
            pages
        };
        // Two sequences' decode rows, the second a few positions shorter.
        let rows = [len - 1, len - 6].map(|pos| QueryRow { pos, table: &table });
        let q: Vec<f32> = (0..rows.len() * 320).map(|i| val(i, 3)).collect();
        for window in [None, Some(SCORE_CHUNK + 5)] {
            for dtype in [ir::DType::F32, ir::DType::F8E4M3] {
                let spec = AttentionSpec {
                    heads: 8,
                    kv_heads: 2,
                    head_dim: 40,
                    scale: 0.2,
                    window,
                    cache_slot: 0,
                    cache_dtype: dtype,
                };
                let pages = pages_of(dtype);
                let layer = pages.layer(0);
                match layer.typed() {
                    PagesOf::F32(pages) => check_split(&spec, &q, &rows, &Cache { pages, block_size: 2 }, layer),
                    PagesOf::F8(pages) => check_split(&spec, &q, &rows, &Cache { pages, block_size: 2 }, layer),
                    _ => unreachable!("the slots made above"),
                }
            }
        }
    }

    fn check_split<T: KvElement>(
        spec: &AttentionSpec,
        q: &[f32],
        rows: &[QueryRow],
        kv: &Cache<T>,
        layer: &LayerPages,
    ) {
        let bits = |out: Vec<f32>| out.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let what = format!("{:?}, window {:?}", spec.cache_dtype, spec.window);
        let mut one = vec![f32::NAN; rows.len() * 320];
        attend::<1, 1, 1, T>(spec, q, rows, &row_tiles(rows, 1), kv, &mut one);
        let one = bits(one);
        let split = |attend: AttendSplit<T>| {
            let mut out = vec![f32::NAN; rows.len() * 320];
            attend(spec, q, rows, kv, &mut out);
            bits(out)
        };
        assert_eq!(split(attend_split::<1, T>), one, "{what}");
        assert_eq!(split(attend_split::<2, T>), one, "{what}");
        assert_eq!(split(attend_split::<4, T>), one, "{what}");
        let mut out = vec![f32::NAN; 320];
        attention(spec, &q[..320], &rows[..1], layer, &mut out);
        assert_eq!(bits(out), one[..320], "attention, {what}");
    }

    /// Tiles over a step of several sequences (a prompt chunk cut into tiles of four and a
    /// short last one, a decode row, a chunk continuing from a cache), with and without a
    /// window narrower than a tile's reach, give every row its one-row results bit for bit.
    #[test]
    fn row_tiles_over_sequences_and_windows_get_their_one_row_results() {
        for window in [None, Some(3), Some(6)] {
            let spec = AttentionSpec {
                heads: 8,
                kv_heads: 2,
                head_dim: 32,
                scale: 0.2,
                window,
                cache_slot: 0,
                cache_dtype: ir::DType::F32,
            };
            let kv_dim = 64;
            let val = |i: usize, m: usize| ((i * m % 31) as f32 - 15.0) / 8.0;
            let tables = [[2, 0, 5, 1, 4, 3], [8, 6, 7, 9, 10, 11]].map(|t| t.map(BlockId));
            let mut pages = f32_pages(kv_dim);
            for (s, table) in tables.iter().enumerate() {
                let k: Vec<f32> = (0..12 * kv_dim).map(|i| val(i + s, 7)).collect();
                let v: Vec<f32> = (0..12 * kv_dim).map(|i| val(i + s, 5)).collect();
                pages.layer_mut(0).write(table, 0, &k, &v);
            }
            let mut rows: Vec<QueryRow> = (0..11).map(|pos| QueryRow { pos, table: &tables[0] }).collect();
            rows.push(QueryRow {
                pos: 9,
                table: &tables[1],
            });
            rows.extend((4..7).map(|pos| QueryRow { pos, table: &tables[1] }));
            let tiles = row_tiles(&rows, 4);
            assert_eq!(tiles, [0..4, 4..8, 8..11, 11..12, 12..15]);
            let q: Vec<f32> = (0..rows.len() * 256).map(|i| val(i, 3)).collect();
            let run = |attend: Attend, tiles: &[Range<usize>]| {
                let mut out = vec![f32::NAN; rows.len() * 256];
                attend(&spec, &q, &rows, tiles, &f32_cache(pages.layer(0)), &mut out);
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let one = run(attend::<1, 1, 1, f32>, &row_tiles(&rows, 1));
            assert_eq!(run(attend::<1, 4, 4, f32>, &tiles), one, "{window:?}, one head");
            assert_eq!(run(attend::<4, 4, 16, f32>, &tiles), one, "{window:?}, four heads");
        }
    }

    /// Whatever vector width the CPU gives it, the softmax has the portable loop's bits (at
    /// lengths around whole chunks of lanes, and with scores `e^x` flushes to zero).
    #[test]
    fn softmax_has_the_portable_bits_at_every_width() {
        for len in [1, 7, 15, 16, 17, 40, 64, 301] {
            let scores: Vec<f32> = (0..len).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.73).collect();
            let (mut vector, mut portable) = (scores.clone(), scores);
            softmax(&mut vector, 0.9);
            softmax_body(&mut portable, 0.9);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&vector), bits(&portable), "{len} scores");
        }
    }

    /// Against the reference, for caches of f32, bf16, half and FP8 rows (the reference rounds
    /// the values it caches the same way).
    #[test]
    fn agrees_with_reference_including_windows_groups_and_narrow_caches() {
        let dtypes = [ir::DType::F32, ir::DType::BF16, ir::DType::F16, ir::DType::F8E4M3];
        for (window, cache_dtype) in [None, Some(3)].into_iter().flat_map(|w| dtypes.map(|d| (w, d))) {
            let spec = AttentionSpec {
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                scale: 0.3,
                window,
                cache_slot: 0,
                cache_dtype,
            };
            let (len, tokens) = (9, 4);
            let kv_dim = 32;
            let val = |i: usize, m: usize| ((i * m % 23) as f32 - 11.0) / 7.0;
            let k: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 7)).collect();
            let v: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 5)).collect();
            // Blocks of 2 positions, scattered: the table is not in block order.
            let table = [4, 0, 3, 1, 2].map(BlockId);
            let layout = super::super::KvLayout {
                dim: kv_dim,
                v_dim: kv_dim,
                dtype: cache_dtype,
            };
            let mut pages = super::super::KvPages::new(&[layout], &[], 2);
            pages.layer_mut(0).write(&table, 0, &k, &v);
            let q: Vec<f32> = (0..tokens * 64).map(|i| val(i, 3)).collect();
            let first = len - tokens;
            let rows: Vec<QueryRow> = (first..len).map(|pos| QueryRow { pos, table: &table }).collect();
            let mut got = vec![f32::NAN; tokens * 64];
            attention(&spec, &q, &rows, pages.layer(0), &mut got);
            let stored = |x: &[f32]| {
                x.iter()
                    .map(|&e| ir::reference::ops::stored_as(e, cache_dtype))
                    .collect()
            };
            let slot = KvSlot {
                positions: (0..len).collect(),
                k: stored(&k),
                v: stored(&v),
            };
            let positions: Vec<usize> = (first..len).collect();
            let want = attention_over_slot(&spec, &Tensor::new(vec![tokens, 64], q.clone()), &slot, &positions);
            for (g, w) in got.iter().zip(&want.data) {
                assert!((g - w).abs() < 1e-5, "{window:?} {cache_dtype}: {g} vs {w}");
            }
            if cache_dtype != ir::DType::F32 {
                let unrounded = KvSlot {
                    positions: (0..len).collect(),
                    k,
                    v,
                };
                let exact = attention_over_slot(&spec, &Tensor::new(vec![tokens, 64], q), &unrounded, &positions);
                assert!(
                    got.iter().zip(&exact.data).any(|(g, e)| g != e),
                    "{cache_dtype} rows are rounded"
                );
            }
        }
    }
}
