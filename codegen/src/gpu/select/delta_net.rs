//! A Gated DeltaNet layer's launches (`templates::delta_net`): the convolution into scratch,
//! the window shift, then the delta rule into the node's value, each sequence's state in its
//! slot of the layer's recurrent state buffer. The delta rule comes in two forms, each launch
//! gated by the step's shape (`templates::step_gate`): in chunks (`templates::delta_chunks`)
//! in the steps whose sequences average [`CHUNKED_ROWS_PER_SEQUENCE`] rows or more (prompts),
//! a row at a time in the others (decode rows, drafts being verified).

use super::{scalar, Alternatives, Operands, Selected};
use crate::gpu::{GpuCodegenError, LaunchArg, PrefillDeltaRule, StateLayout};
use kernels_gen::dsl::Kernel;
use kernels_gen::templates::cache_layout::CacheLayout;
use kernels_gen::templates::{delta_chunks, delta_net, flash_attention, step_gate};

/// Rows a sequence from which a step's delta rule runs in chunks: below it a chunk's fixed
/// work (its 64-row products, a second launch) outweighs walking the rows, which the
/// recurrent form does at the recurrence's latency a row. Prefill attention switches to the
/// tensor cores at the same count.
pub const CHUNKED_ROWS_PER_SEQUENCE: usize = 16;

/// The scalar gating the two forms' launches.
const GATE: &str = "launched";

/// Records the layer's state and pushes the convolution and window launches; returns the last
/// (the delta rule) for the caller to push as the node's own.
pub(super) fn launches(
    s: &mut Selected,
    operands: &Operands,
    (spec, prefill): (&ir::DeltaNetSpec, PrefillDeltaRule),
    layout: CacheLayout,
    rows: &str,
    max_tokens: usize,
) -> Result<(Kernel, Vec<LaunchArg>), GpuCodegenError> {
    let conv_weights = operands.weight_format(3)?;
    let [(x, x_stride), (b, b_stride), (a, a_stride)] = [0, 1, 2].map(|k| operands.activation(s, k));
    s.recurrent_states.push(StateLayout {
        slot: spec.state_slot,
        len: spec.state_len(),
    });
    let state = LaunchArg::RecurrentState { slot: spec.state_slot };
    let convolved = operands.scratch("conv", spec.conv_channels(), max_tokens);
    // Where each sequence's rows and state are, and where states after rows are kept
    // (`templates::delta_net`).
    let step_input = |name: &str| LaunchArg::StepInput { name: name.into() };
    let (seqs, sequences, checkpoints) = match layout {
        CacheLayout::Batched => (
            "seqs",
            ["last_rows", "row_pos", "row_seq", "state_slots"]
                .map(step_input)
                .to_vec(),
            vec![
                LaunchArg::StateCheckpoints { slot: spec.state_slot },
                step_input("row_checkpoint"),
            ],
        ),
        _ => ("1", vec![scalar("first", "first")], vec![]),
    };
    let origin = operands.origin();
    let conv_args = vec![
        x.clone(),
        operands.weight(3),
        state.clone(),
        convolved.clone(),
        scalar("tokens", rows),
        scalar("x_stride", x_stride),
    ];
    let window_args = vec![
        x,
        state.clone(),
        scalar("seqs", seqs),
        scalar("tokens", rows),
        scalar("x_stride", x_stride),
    ];
    for (kernel, args) in [
        (
            delta_net::conv("delta_net_conv", origin, layout, spec, conv_weights),
            [conv_args, sequences.clone(), checkpoints.clone()].concat(),
        ),
        (
            delta_net::conv_window("delta_net_window", origin, layout, spec),
            [window_args, sequences.clone()].concat(),
        ),
    ] {
        s.launches.push((operands.node, kernel, Alternatives::default(), args));
    }
    let rule_args = vec![
        convolved,
        b,
        a,
        operands.weight(4),
        operands.weight(5),
        state,
        operands.out(),
        scalar("seqs", seqs),
        scalar("tokens", rows),
        scalar("b_stride", b_stride),
        scalar("a_stride", a_stride),
    ];
    let recurrent = delta_net::delta_rule("delta_rule", origin, layout, spec);
    if prefill == PrefillDeltaRule::Recurrent || !delta_chunks::supports(spec) {
        return Ok((recurrent, [rule_args, sequences, checkpoints].concat()));
    }
    let per_sequence = CHUNKED_ROWS_PER_SEQUENCE;
    let chunked = match layout {
        CacheLayout::Batched => format!("min(1,({rows})/({per_sequence}*seqs))"),
        _ => format!("min(1,({rows})/{per_sequence})"),
    };
    let scratch: Vec<LaunchArg> = delta_chunks::scratch(spec)
        .into_iter()
        .map(|(name, per_row)| operands.scratch(name, per_row, max_tokens))
        .collect();
    // `rule_args` as the recurrent kernel takes them: the convolved rows, b, a, a_log and
    // dt_bias (0..5), the state and the output (5..7), seqs and tokens (7, 8), the strides of
    // b and a (9..11).
    let tiles = match layout {
        CacheLayout::Batched => vec![
            step_input(&flash_attention::query_tiles_input(delta_chunks::CHUNK)),
            rule_args[7].clone(),
        ],
        _ => vec![],
    };
    let prepare_args = [
        &rule_args[..5],
        &scratch,
        &[rule_args[8].clone()],
        &rule_args[9..11],
        &tiles,
        &[scalar(GATE, &chunked)],
    ]
    .concat();
    let state_args = [
        &rule_args[..1],
        &scratch,
        &rule_args[5..9],
        &sequences,
        &checkpoints,
        &[scalar(GATE, &chunked)],
    ]
    .concat();
    for (kernel, args) in [
        (
            delta_chunks::chunk_prepare("delta_chunk_prepare", origin, layout, spec),
            prepare_args,
        ),
        (
            delta_chunks::chunk_state("delta_chunk_state", origin, layout, spec),
            state_args,
        ),
    ] {
        s.launches.push((
            operands.node,
            step_gate::gated(kernel, GATE),
            Alternatives::default(),
            args,
        ));
    }
    let recurrent_args = [
        rule_args,
        sequences,
        checkpoints,
        vec![scalar(GATE, format!("1-{chunked}"))],
    ]
    .concat();
    Ok((step_gate::gated(recurrent, GATE), recurrent_args))
}
