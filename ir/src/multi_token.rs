//! The names by which a model and its multi-token prediction head pass hidden states: what the
//! model's graph outputs for the head to read, and what the head's graph outputs for its next
//! chained step (the lowering writes them, the serving engine's drafter reads them).

/// The target's output: its normed hidden state at every row of a step.
pub const TARGET_HIDDEN_STATES: &str = "hidden_states";

/// The head's output: the hidden state of its last row, which its next chained step reads in
/// place of the target's.
pub const DRAFT_HIDDEN_STATE: &str = "draft_hidden_state";
