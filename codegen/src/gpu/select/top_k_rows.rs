//! A row's top k as launches: `templates::top_k`'s rounds for an argmax (one pass over the
//! row, one block a row), `templates::top_k_sort`'s chunk sorts and merges above it (one pass
//! over the row, spread over its chunks' blocks, then merges of the chunks' lists).

use super::scalar;
use crate::gpu::LaunchArg;
use kernels_gen::dsl::Kernel;
use kernels_gen::templates::{top_k, top_k_sort};

/// The largest k that takes `top_k`'s rounds: an argmax is one round, and each round is a
/// block reading the whole row; from two on, the chunk sorts read it once in all, many blocks
/// at a time.
const MOST_ROUNDS: usize = 1;

/// The launches that write the top `k` indices of each of `rows` rows of `logits` (`v` wide)
/// into `out` (`k` a row, largest first), their kernels named after `name`. `scratch(name,
/// per_row)` is the node's scratch buffer of `per_row` four-byte values a row.
pub(super) fn launches(
    name: &str,
    origin: &str,
    (logits, out): (LaunchArg, LaunchArg),
    rows: &str,
    (v, k): (usize, usize),
    scratch: &dyn Fn(&str, usize) -> LaunchArg,
) -> Vec<(Kernel, Vec<LaunchArg>)> {
    if k <= MOST_ROUNDS || k > top_k_sort::MAX_K {
        let args = vec![logits, out, scalar("rows", rows), scalar("v", v), scalar("k", k)];
        return vec![(top_k::top_k(name, origin), args)];
    }
    let passes = top_k_sort::passes(v, k);
    // Each pass's lists go to one of two pairs of buffers, alternately, each sized for the
    // most lists a pass writes there; the last pass's indices go to `out`.
    let widest = |n: usize| passes.iter().skip(n % 2).step_by(2).map(|p| p.lists_out * k).max();
    let pair = |n: usize, what: &str| scratch(&format!("sorted_{what}_{}", n % 2), widest(n).unwrap_or(0));
    let last = passes.len() - 1;
    passes
        .iter()
        .enumerate()
        .map(|(n, pass)| {
            let (kernel, mut args) = match n {
                0 => (
                    top_k_sort::chunks(&format!("{name}_chunks"), origin, pass.len),
                    vec![logits.clone(), scalar("v", v)],
                ),
                _ => (
                    top_k_sort::merge(&format!("{name}_merge"), origin, pass.len),
                    vec![
                        pair(n - 1, "keys"),
                        pair(n - 1, "ids"),
                        scalar("lists_in", pass.lists_in),
                    ],
                ),
            };
            let ids = if n == last { out.clone() } else { pair(n, "ids") };
            args.extend([
                pair(n, "keys"),
                ids,
                scalar("rows", rows),
                scalar("k", k),
                scalar("lists_out", pass.lists_out),
            ]);
            (kernel, args)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels_gen::dsl::Param;
    use kernels_gen::emulator::{run, Array, Scalar};
    use std::collections::HashMap;

    /// The launches run in order on the emulator, buffers bound by what the arguments name
    /// (scratch by name, activations by node: the logits node 0, `out_len` indices node 1),
    /// so a pass reading the wrong buffer or size shows.
    fn run_launches(launches: &[(Kernel, Vec<LaunchArg>)], logits: &[f32], out_len: usize) -> Vec<i64> {
        let key = |arg: &LaunchArg| match arg {
            LaunchArg::Scratch { name, .. } => name.clone(),
            LaunchArg::Activation { node, .. } => format!("node {node}"),
            other => panic!("unexpected argument {other:?}"),
        };
        let mut memory = HashMap::from([("node 0".to_string(), Array::f32(logits))]);
        for (kernel, args) in launches {
            assert_eq!(kernel.launch_params().count(), args.len(), "{}", kernel.name);
            let (mut bufs, mut scalars, mut bound) = (HashMap::new(), HashMap::new(), Vec::new());
            for (param, arg) in kernel.launch_params().zip(args) {
                match (param, arg) {
                    (Param::Buffer { name, ty, .. }, arg) => {
                        let bytes = match arg {
                            LaunchArg::Scratch { bytes, .. } => *bytes,
                            _ => out_len * 4,
                        };
                        let array = memory
                            .remove(&key(arg))
                            .unwrap_or_else(|| Array::poisoned(*ty, bytes / 4));
                        bufs.insert(name.clone(), array);
                        bound.push((name.clone(), key(arg)));
                    }
                    (Param::Scalar { name, .. }, LaunchArg::Scalar { value, .. }) => {
                        scalars.insert(name.clone(), Scalar::Int(value.parse().unwrap()));
                    }
                    (param, arg) => panic!("{param:?} bound to {arg:?}"),
                }
            }
            run(kernel, &mut bufs, &scalars).unwrap();
            for (name, key) in bound {
                memory.insert(key, bufs.remove(&name).unwrap());
            }
        }
        memory["node 1"].to_i64().unwrap()
    }

    #[test]
    fn every_pass_reads_what_the_one_before_wrote() {
        let rows = 2;
        for (v, k) in [(9000, 1000), (9000, 64), (300, 64), (300, 1)] {
            let logits: Vec<f32> = (0..rows * v).map(|i| ((i * 7919) % 4099) as f32).collect();
            let scratch = |name: &str, per_row: usize| LaunchArg::Scratch {
                node: 1,
                name: name.into(),
                bytes: rows * per_row * 4,
            };
            let activation = |node| LaunchArg::Activation {
                node,
                offset: "0".into(),
            };
            let launches = launches(
                "top_k",
                "test",
                (activation(0), activation(1)),
                &rows.to_string(),
                (v, k),
                &scratch,
            );
            let want: Vec<i64> = (0..rows)
                .flat_map(|r| ir::reference::ops::top_k(&logits[r * v..(r + 1) * v], k))
                .map(|i| i as i64)
                .collect();
            let got = run_launches(&launches, &logits, rows * k);
            assert_eq!(got, want, "v = {v}, k = {k}: {} launches", launches.len());
        }
    }
}
