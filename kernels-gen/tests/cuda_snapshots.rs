//! The generated CUDA C of every template, snapshot-tested (review diffs like code), and
//! stable: the same kernel always prints the same source.

use kernels_gen::{cuda, templates, types};

#[test]
fn every_template_emits_stable_cuda() {
    for kernel in templates::catalog() {
        types::check(&kernel).unwrap();
        let source = cuda::emit(&kernel);
        assert_eq!(source, cuda::emit(&kernel), "{} is not deterministic", kernel.name);
        insta::assert_snapshot!(kernel.name.clone(), source);
    }
}
