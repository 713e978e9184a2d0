//! The split pass of [`super::attention`] reading the cache 16 bytes a lane: each lane loads 8
//! consecutive bf16 or halves (4 f32, 16 FP8 codes) of a key or value row at once, the lanes
//! of a subgroup cover one row (16 lanes at a 128-dim bf16 head, 256 bytes; 8 over FP8), and a
//! warp takes as many keys at once as it has subgroups, [`LOADS_PER_LANE`] loads of keys and
//! as many of values before it computes.
//!
//! Why: the split pass's warp walks one key at a time, each lane reading 2 bytes of the row,
//! so a warp has one key and one value row (512 bytes at a 128-dim bf16 head) in flight and
//! waits for them before its score's reduction and its online softmax. A decode step of
//! many sequences over long caches is bound by how many bytes are in flight (Little's law:
//! an H200's 4.8 TB/s at ~0.7 µs of latency wants ~25 KB in flight per multiprocessor);
//! here each warp has 4 keys and 4 values (2 KB) in flight at a 128-dim bf16 head, each 16
//! bytes of a row one load instead of eight 2-byte ones, and rescales its
//! accumulators once per 2 keys a lane rather than once per key.
//!
//! Each lane keeps the online-softmax state of the keys its subgroup took; the subgroups of a
//! warp merge by shuffles at the end, then the warps through shared memory as in the split
//! pass, which writes the same partials (`attention_combine` merges either). Keys past the
//! span's end (its last iteration) load the span's last row and are masked out of the softmax.

use super::attention::{
    merge_warp_states, split_keys, split_pass_kernel, store_max_and_sum, warp_slot, weight_of, WARPS,
};
use super::cache_layout::CacheLayout;
use crate::dsl::*;

/// 16-byte loads of key rows a lane issues before it computes an iteration's scores (and as
/// many of value rows): the keys a lane takes per iteration are this many divided by the
/// loads one row takes per lane (at least one key).
pub const LOADS_PER_LANE: usize = 2;

/// How a head's row is cut across a warp: `width` elements per 16-byte load, `lanes` lanes per
/// row (a power of two up to 32), each taking `chunks` loads of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowCut {
    width: usize,
    lanes: usize,
    chunks: usize,
}

impl RowCut {
    /// The cut of a `head_dim` row of `cache` elements, where one exists: the row a whole
    /// number of 16-byte loads, a power of two of them (every model's head is).
    fn of(head_dim: usize, cache: Ty) -> Option<Self> {
        let width = 16 / cache.bytes();
        let loads = head_dim / width;
        let fits = matches!(cache, Ty::F32 | Ty::Bf16 | Ty::F16 | Ty::F8E4M3)
            && head_dim.is_multiple_of(width)
            && loads.is_power_of_two()
            && head_dim <= super::attention::MAX_HEAD_DIM;
        fits.then(|| {
            let lanes = loads.min(32);
            Self {
                width,
                lanes,
                chunks: loads / lanes,
            }
        })
    }

    /// Elements of a row each lane holds.
    fn dims_per_lane(self) -> usize {
        self.chunks * self.width
    }

    /// Keys a warp's lanes load at once: one a subgroup.
    fn keys_per_load(self) -> usize {
        32 / self.lanes
    }

    /// Keys each lane takes per iteration.
    fn keys_per_lane(self) -> usize {
        (LOADS_PER_LANE / self.chunks).max(1)
    }

    /// Lane `lane`'s `e`-th element of its `c`-th load: chunk `c · lanes + lane % lanes` of the
    /// row, so a subgroup's lanes read consecutive 16 bytes.
    fn dim(self, c: usize, e: usize) -> Expr {
        (int((c * self.lanes) as i64) + var("part")) * int(self.width as i64) + int(e as i64)
    }
}

/// Whether the vector split pass takes a `head_dim` head over a cache of `cache` elements
/// (f32, bf16, half or FP8, the row a power of two of 16-byte loads, at most
/// `MAX_HEAD_DIM`); the others take `attention::attention_split`.
pub fn supports(head_dim: usize, cache: Ty) -> bool {
    RowCut::of(head_dim, cache).is_some()
}

/// Query heads one block takes: as `attention::heads_per_block`, against this pass's dims per
/// lane (`heads_per_block × dims per lane` ≤ 32 of each of queries and accumulators). Panics
/// where [`supports`] is false.
pub fn heads_per_block(heads: usize, kv_heads: usize, head_dim: usize, cache: Ty) -> usize {
    let cut = RowCut::of(head_dim, cache).expect("a head the vector split pass supports");
    super::attention::largest_group(heads, kv_heads, cut.dims_per_lane())
}

/// The split pass over a cache in `layout` with 16-byte loads (see the module's comment):
/// the parameters, grid and partials of `attention::attention_split`, whose launch it
/// replaces. Panics where [`supports`] is false.
pub fn attention_split_vector(
    name: &str,
    origin: &str,
    layout: CacheLayout,
    head_dim: usize,
    group: usize,
    cache: Ty,
) -> Kernel {
    let cut = RowCut::of(head_dim, cache).unwrap_or_else(|| panic!("no 16-byte cut of a {head_dim}-dim {cache:?} row"));
    assert!(group >= 1, "a block takes at least one head");
    let (keys_per_lane, keys_per_load) = (cut.keys_per_lane(), cut.keys_per_load());
    let keys_per_warp = (keys_per_lane * keys_per_load) as i64;
    let hd = int(head_dim as i64);
    let elements = |c: usize| (0..cut.width).map(move |e| (c, e));
    let each_dim = || (0..cut.chunks).flat_map(elements);
    let qv = |g: usize, (c, e): (usize, usize)| format!("q{g}_{c}_{e}");
    let acc = |g: usize, (c, e): (usize, usize)| format!("acc{g}_{c}_{e}");
    let row = |which: &str, u: usize, (c, e): (usize, usize)| format!("{which}{u}_{c}_{e}");
    let score = |g: usize, u: usize| format!("s{g}_{u}");

    let mut body = split_keys(layout, group);
    body.extend([
        let_("sub", Ty::I32, lane() / int(cut.lanes as i64)),
        let_("part", Ty::I32, rem(lane(), int(cut.lanes as i64))),
    ]);
    // The queries, pre-scaled, in registers: this lane's dims of each head.
    for g in 0..group {
        let head = var("t") * var("q_stride") + (var("h0") + int(g as i64)) * hd.clone();
        for d in each_dim() {
            let at = head.clone() + cut.dim(d.0, d.1);
            body.push(let_(&qv(g, d), Ty::F32, load("q", at) * var("scale")));
            body.push(let_(&acc(g, d), Ty::F32, f(0.0)));
        }
        body.extend([
            let_(&format!("m{g}"), Ty::F32, f(f32::NEG_INFINITY)),
            let_(&format!("l{g}"), Ty::F32, f(0.0)),
        ]);
    }

    // An iteration: the warp's keys from `j`, lane-subgroup `sub` taking every
    // `keys_per_load`-th. Every load first, then the scores.
    let mut step = Vec::new();
    for u in 0..keys_per_lane {
        let key = format!("key{u}");
        step.extend([
            let_(&key, Ty::I32, var("j") + int((u * keys_per_load) as i64) + var("sub")),
            let_(&format!("ok{u}"), Ty::Bool, lt(var(&key), var("end"))),
            let_(
                &format!("base{u}"),
                Ty::I32,
                (layout.row(bin(BinOp::Min, var(&key), var("end") - int(1))) * var("kv_heads") + var("kvh"))
                    * hd.clone(),
            ),
        ]);
    }
    for which in ["k", "v"] {
        for u in 0..keys_per_lane {
            for c in 0..cut.chunks {
                let names: Vec<String> = elements(c).map(|d| row(which, u, d)).collect();
                step.push(load_vec(which, var(&format!("base{u}")) + cut.dim(c, 0), &names));
            }
        }
    }
    for g in 0..group {
        for u in 0..keys_per_lane {
            let dot = each_dim()
                .map(|d| var(&qv(g, d)) * var(&row("k", u, d)))
                .reduce(|a, b| a + b)
                .expect("a dim per lane");
            let s = score(g, u);
            step.push(let_(&s, Ty::F32, dot));
            step.extend(subgroup_sum(&s, cut.lanes));
            step.push(assign(
                &s,
                select(var(&format!("ok{u}")), var(&s), f(f32::NEG_INFINITY)),
            ));
        }
    }
    for g in 0..group {
        let (m, l) = (format!("m{g}"), format!("l{g}"));
        let (m_new, c) = (format!("m_new{g}"), format!("c{g}"));
        let p = |u: usize| format!("p{g}_{u}");
        let top = (0..keys_per_lane).fold(var(&m), |top, u| bin(BinOp::Max, top, var(&score(g, u))));
        step.extend([
            let_(&m_new, Ty::F32, top),
            let_(&c, Ty::F32, weight_of(var(&m), var(&m_new))),
        ]);
        for u in 0..keys_per_lane {
            step.push(let_(&p(u), Ty::F32, weight_of(var(&score(g, u)), var(&m_new))));
        }
        let sum = (0..keys_per_lane).fold(var(&l) * var(&c), |sum, u| sum + var(&p(u)));
        step.push(assign(&l, sum));
        for d in each_dim() {
            let a = acc(g, d);
            let weighted = (0..keys_per_lane).fold(var(&a) * var(&c), |sum, u| sum + var(&p(u)) * var(&row("v", u, d)));
            step.push(assign(&a, weighted));
        }
        step.push(assign(&m, var(&m_new)));
    }
    body.push(for_(
        "j",
        var("start") + warp() * int(keys_per_warp),
        var("end"),
        int(keys_per_warp * WARPS as i64),
        step,
    ));

    // The subgroups' states merged by shuffles, then subgroup 0's stored for the block merge.
    let mut mask = cut.lanes;
    while mask < 32 {
        for g in 0..group {
            body.extend(merge_with_lane(g, mask as u32, each_dim().map(|d| acc(g, d)).collect()));
        }
        mask *= 2;
    }
    // A lane's accumulators of a load are consecutive dims: 16-byte stores, 4 floats each.
    let mut stores = Vec::new();
    for g in 0..group {
        stores.push(store_max_and_sum(g, group));
        for c in 0..cut.chunks {
            for first in (0..cut.width).step_by(4) {
                stores.push(store_vec(
                    "warp_acc",
                    warp_slot(g, group) * hd.clone() + cut.dim(c, first),
                    (first..first + 4).map(|e| var(&acc(g, (c, e)))).collect(),
                ));
            }
        }
    }
    body.push(if_(lt(lane(), int(cut.lanes as i64)), stores));
    body.extend(merge_warp_states(head_dim, group));

    let form = format!(
        ", 16-byte loads ({} lanes a row, {keys_per_warp} keys a warp at once)",
        cut.lanes
    );
    split_pass_kernel((name, origin, &form), (layout, head_dim, group, cache), body)
}

/// `value` summed over each aligned subgroup of `lanes` lanes (every lane of it ends with the
/// sum).
fn subgroup_sum(value: &str, lanes: usize) -> Vec<Stmt> {
    let mut masks = Vec::new();
    let mut mask = lanes / 2;
    while mask >= 1 {
        masks.push(mask as u32);
        mask /= 2;
    }
    masks
        .into_iter()
        .map(|m| assign(value, var(value) + shfl_xor(var(value), m)))
        .collect()
}

/// Head `g`'s online-softmax state (`m{g}`, `l{g}`, the accumulators `accs`) merged with that
/// of the lane `mask` away, which holds the same dims of other keys: each weighted by its max
/// against the larger.
fn merge_with_lane(g: usize, mask: u32, accs: Vec<String>) -> Vec<Stmt> {
    let (m, l) = (format!("m{g}"), format!("l{g}"));
    let named = |what: &str| format!("{what}{g}_x{mask}");
    let (m_other, top, w, w_other) = (named("m_other"), named("top"), named("w"), named("w_other"));
    let mut s = vec![
        let_(&m_other, Ty::F32, shfl_xor(var(&m), mask)),
        let_(&top, Ty::F32, bin(BinOp::Max, var(&m), var(&m_other))),
        let_(&w, Ty::F32, weight_of(var(&m), var(&top))),
        let_(&w_other, Ty::F32, weight_of(var(&m_other), var(&top))),
        assign(&l, var(&l) * var(&w) + shfl_xor(var(&l), mask) * var(&w_other)),
    ];
    for a in accs {
        s.push(assign(&a, var(&a) * var(&w) + shfl_xor(var(&a), mask) * var(&w_other)));
    }
    s.push(assign(&m, var(&top)));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every head the vector pass takes is cut into whole 16-byte loads across a power of
        /// two of lanes that tile the warp, each lane loading at least `LOADS_PER_LANE` of keys
        /// an iteration, and a block's heads fit the register budget and divide their KV
        /// head's group.
        #[test]
        fn rows_are_cut_into_whole_loads_and_groups_fit(
            loads_log2 in 0u32..8,
            cache in prop_oneof![Just(Ty::F32), Just(Ty::Bf16), Just(Ty::F16), Just(Ty::F8E4M3)],
            kv_heads in 1usize..9,
            group_heads in 1usize..13,
        ) {
            let width = 16 / cache.bytes();
            let head_dim = width << loads_log2;
            prop_assume!(head_dim <= super::super::attention::MAX_HEAD_DIM);
            prop_assert!(supports(head_dim, cache));
            let cut = RowCut::of(head_dim, cache).unwrap();
            prop_assert!(cut.lanes.is_power_of_two() && cut.lanes <= 32);
            prop_assert_eq!(cut.lanes * cut.chunks * cut.width, head_dim);
            prop_assert_eq!(cut.keys_per_load() * cut.lanes, 32);
            prop_assert!(cut.keys_per_lane() >= 1 && cut.keys_per_lane() * cut.chunks >= LOADS_PER_LANE);
            let heads = kv_heads * group_heads;
            let group = heads_per_block(heads, kv_heads, head_dim, cache);
            prop_assert!(group_heads % group == 0);
            prop_assert!(group == 1 || group * cut.dims_per_lane() <= 32);
        }
    }

    /// Heads that are not a power of two of 16-byte loads and heads past the largest keep the
    /// scalar pass; Llama 3 8B's takes its whole group of 4 a block over bf16 and half caches,
    /// 2 over FP8 (16 codes a load: 16 dims a lane).
    #[test]
    fn the_vector_pass_takes_what_it_cuts() {
        assert!(!supports(80, Ty::Bf16));
        assert!(!supports(96, Ty::F32));
        assert!(!supports(8, Ty::F8E4M3) && !supports(96, Ty::F16));
        assert!(supports(128, Ty::F16) && supports(128, Ty::F8E4M3) && supports(16, Ty::F8E4M3));
        assert!(!supports(1024, Ty::Bf16));
        assert!(supports(64, Ty::Bf16) && supports(512, Ty::Bf16) && supports(256, Ty::F32));
        assert_eq!(heads_per_block(32, 8, 128, Ty::Bf16), 4);
        assert_eq!(heads_per_block(32, 8, 128, Ty::F16), 4);
        assert_eq!(heads_per_block(32, 8, 128, Ty::F8E4M3), 2);
        // Two loads a lane at 512 dims: 16 dims a lane, two heads a block.
        assert_eq!(heads_per_block(16, 2, 512, Ty::Bf16), 2);
    }
}
