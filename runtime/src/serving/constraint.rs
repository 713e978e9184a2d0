//! Constraints on what a sequence may generate, decided outside the model (structured outputs:
//! a JSON schema, a regular expression, a grammar). The engine masks every row it samples a
//! constrained sequence from and tells the constraint each token taken; what the constraint
//! is made of (a grammar engine over the vocabulary's bytes) is the server's business.

/// What a sequence may take next, advanced token by token.
pub trait TokenConstraint: Send {
    /// Set every token the sequence may not take next to −∞ in `logits` (a row as wide as the
    /// model's vocabulary). At least one token stays allowed: where the constraint cannot go
    /// on (it is complete, or it failed), the tokens that end the sequence.
    fn mask(&mut self, logits: &mut [f32]);
    /// The sequence took `token` (one `mask` allowed).
    fn accept(&mut self, token: u32);
}
