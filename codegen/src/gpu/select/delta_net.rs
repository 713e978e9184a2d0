//! A Gated DeltaNet layer's launches (`templates::delta_net`): the convolution into scratch,
//! the window shift, then the delta rule into the node's value, each sequence's state in its
//! slot of the layer's recurrent state buffer.

use super::{scalar, Alternatives, Operands, Selected};
use crate::gpu::{GpuCodegenError, LaunchArg, StateLayout};
use kernels_gen::dsl::Kernel;
use kernels_gen::templates::cache_layout::CacheLayout;
use kernels_gen::templates::delta_net;

/// Records the layer's state and pushes the convolution and window launches; returns the last
/// (the delta rule) for the caller to push as the node's own.
pub(super) fn launches(
    s: &mut Selected,
    operands: &Operands,
    spec: &ir::DeltaNetSpec,
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
    Ok((
        delta_net::delta_rule("delta_rule", origin, layout, spec),
        [rule_args, sequences, checkpoints].concat(),
    ))
}
