//! A MoE layer's launches (`templates::moe`): routing, the experts' gate/up with their GLU and
//! the weighted down projections into the node's value, row by row; prefill steps run both
//! expert by expert (on tensor cores, `templates::moe_mma`, or for bf16 and f16 experts on
//! Hopper and the B200 `templates::moe_wgmma` and `templates::moe_tcgen05`, after launches
//! that make the rows bf16, or half for half experts, and list each expert's pairs and tiles),
//! and a last launch (empty in other steps) sums the down products.

use super::{scalar, Alternatives, Operands, Selected};
use crate::gpu::{width, GpuCodegenError, LaunchArg, PrefillExperts};
use kernels_gen::dsl::{Kernel, MmaElement, Ty};
use kernels_gen::templates::quant::WeightFormat;
use kernels_gen::templates::{bf16_rows, halves, moe, moe_mma, moe_tcgen05, moe_wgmma};

/// Pushes the routing and gate/up launches; returns the last (the down projections) for the
/// caller to push as the node's own.
pub(super) fn launches(
    s: &mut Selected,
    operands: &Operands,
    (spec, prefill): (&ir::MoeSpec, PrefillExperts),
    (rows, arch): (&str, &str),
    max_tokens: usize,
) -> Result<(Kernel, Vec<LaunchArg>), GpuCodegenError> {
    // Inputs: x, the router's logits, its per-expert vector (grouped routers' score bias,
    // Gemma 4's experts' scales), then the stacked gate/up and down weights.
    let vector = usize::from(spec.has_expert_vector());
    let (gate_up, down) = (2 + vector, 3 + vector);
    let (gate_up_format, down_format) = (operands.weight_format(gate_up)?, operands.weight_format(down)?);
    let ((x, x_stride), (logits, logits_stride)) = (operands.activation(s, 0), operands.activation(s, 1));
    let k = spec.experts_per_token;
    let routes = operands.scratch("routes", k, max_tokens);
    let route_weights = operands.scratch("route_weights", k, max_tokens);
    let hidden = operands.scratch("hidden", k * spec.intermediate, max_tokens);
    // Plain softmax routers have no vector: the logits stand in (never read).
    let expert_vector = match vector {
        1 => operands.weight(2),
        _ => logits.clone(),
    };
    let (d, origin) = (width(operands.graph, operands.node), operands.origin());
    let route = vec![
        logits,
        expert_vector,
        routes.clone(),
        route_weights.clone(),
        scalar("tokens", rows),
        scalar("logits_stride", logits_stride),
    ];
    let gate_up_args = vec![
        x.clone(),
        routes.clone(),
        operands.weight(gate_up),
        hidden.clone(),
        scalar("tokens", rows),
        scalar("x_stride", x_stride),
    ];
    s.launches.push((
        operands.node,
        moe::route("moe_route", origin, spec),
        Alternatives::default(),
        route,
    ));
    // Prefill steps take the experts one by one: each expert's weights read once a step. Their
    // down projections leave each pair's product in `ys`, which a last launch (empty in other
    // steps) sums into the value as the row-by-row kernel does.
    let prefill_only = |kernel| Alternatives {
        batch: None,
        few_rows: None,
        prefill: Some(kernel),
    };
    // 1 in the steps that run the prefill kernels, else 0 (an empty grid).
    let active = scalar("active", format!("min(1,({rows})/{})", crate::gpu::PREFILL_TOKENS));
    // Experts prefill on tensor cores, each expert's pairs listed first (f32 ones, and any
    // whose sizes the tiles do not take, expert by expert on the CUDA cores).
    let tensor_cores = matches!(prefill, PrefillExperts::TensorCores | PrefillExperts::Mma)
        && moe_mma::supports(spec, d, gate_up_format)
        && moe_mma::supports(spec, d, down_format);
    // Half experts (both projections) are multiplied as stored: the bf16 experts' kernels over
    // halves, their rows and hidden units half too. Others decode into bf16 tiles.
    let element = match (gate_up_format, down_format) {
        (WeightFormat::Dense(Ty::F16), WeightFormat::Dense(Ty::F16)) => MmaElement::F16,
        _ => MmaElement::Bf16,
    };
    let tiled = |format: WeightFormat| match element {
        MmaElement::F16 => WeightFormat::Dense(Ty::Bf16),
        MmaElement::Bf16 => format,
    };
    let (gate_up_tiled, down_tiled) = (tiled(gate_up_format), tiled(down_format));
    // Hopper's and the B200's own tensor-core instructions, where the experts are bf16 or half.
    let own = |supports: fn(&ir::MoeSpec, usize, _) -> bool| {
        prefill == PrefillExperts::TensorCores && supports(spec, d, gate_up_tiled) && supports(spec, d, down_tiled)
    };
    let wgmma = arch == "sm_90a" && own(moe_wgmma::supports);
    let tcgen05 = arch == "sm_100a" && own(moe_tcgen05::supports);
    // The tensor cores' inputs after the lists: the rows as bf16 or half (made once a step,
    // only in the steps that run them), which their tiles gather by `cp.async`.
    let (lists, rows_bf16) = match tensor_cores {
        true => {
            let (pairs, counts) = (
                operands.scratch("expert_pairs", spec.experts, max_tokens),
                operands.scratch("expert_counts", spec.experts, 1),
            );
            let bound = moe_mma::tile_bound(spec, kernels_gen::dsl::int(max_tokens as i64));
            let bound = bound.eval_int(&|_| None).expect("a constant bound") as usize;
            let tiles = operands.scratch("pair_tiles", bound, 1);
            let xb = LaunchArg::Scratch {
                node: operands.node,
                name: "expert_rows".into(),
                bytes: max_tokens * d * 2,
            };
            let rows_name = format!("{}_rows", element.ptx());
            s.launches.push((
                operands.node,
                bf16_rows::rows_of(element, &rows_name, origin, None, crate::gpu::PREFILL_TOKENS),
                Alternatives::default(),
                vec![
                    x.clone(),
                    xb.clone(),
                    scalar("tokens", rows),
                    scalar("k", d),
                    scalar("x_stride", x_stride),
                    scalar("xb_stride", d),
                ],
            ));
            let group = vec![
                routes.clone(),
                pairs.clone(),
                counts.clone(),
                scalar("tokens", rows),
                active.clone(),
            ];
            s.launches.push((
                operands.node,
                moe_mma::group_pairs("moe_group_pairs", origin, spec),
                Alternatives::default(),
                group,
            ));
            let list = vec![counts.clone(), tiles.clone(), scalar("tokens", rows), active.clone()];
            s.launches.push((
                operands.node,
                moe_mma::list_tiles("moe_list_tiles", origin, spec),
                Alternatives::default(),
                list,
            ));
            (vec![pairs, counts, tiles], vec![xb, scalar("xb_stride", d)])
        }
        false => (vec![], vec![]),
    };
    let over = |kernel: Kernel| halves::multiplying(element, kernel);
    let (prefill_gate_up, prefill_down) = match tensor_cores {
        true if wgmma => (
            over(moe_wgmma::gate_up("moe_gate_up", origin, spec, d)),
            over(moe_wgmma::down("moe_down", origin, spec, d)),
        ),
        true if tcgen05 => (
            over(moe_tcgen05::gate_up("moe_gate_up", origin, spec, d)),
            over(moe_tcgen05::down("moe_down", origin, spec, d)),
        ),
        true => (
            over(moe_mma::gate_up("moe_gate_up", origin, spec, d, gate_up_tiled)),
            over(moe_mma::down("moe_down", origin, spec, d, down_tiled)),
        ),
        false => (
            moe::gate_up_by_expert("moe_gate_up", origin, spec, d, gate_up_format),
            moe::down_by_expert("moe_down", origin, spec, d, down_format),
        ),
    };
    s.launches.push((
        operands.node,
        moe::gate_up("moe_gate_up", origin, spec, d, gate_up_format),
        prefill_only(prefill_gate_up),
        [gate_up_args, lists.clone(), rows_bf16].concat(),
    ));
    let ys = operands.scratch("ys", k * d, max_tokens);
    let down_args = vec![
        hidden,
        routes,
        route_weights.clone(),
        operands.weight(down),
        operands.out(),
        scalar("tokens", rows),
        ys.clone(),
    ];
    s.launches.push((
        operands.node,
        moe::down("moe_down", origin, spec, d, down_format),
        prefill_only(prefill_down),
        [down_args, lists].concat(),
    ));
    let combine = vec![ys, route_weights, operands.out(), scalar("tokens", rows), active];
    Ok((moe::combine("moe_combine", origin, spec, d), combine))
}
