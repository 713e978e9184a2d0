//! Every generated kernel compiles with NVRTC for sm_90a, sm_100a and sm_120a with zero spill
//! bytes, as artifacts build it (`spill_free`: asking ptxas for an occupancy where its own
//! choice spills). Skipped (with a message) where NVRTC is not installed, unless
//! BBC_REQUIRE_NVRTC is set, as CI sets it after installing the PyPI wheel.

use codegen::{nvrtc, spill_free};
use kernels_gen::{cuda, templates};

const ARCHS: [&str; 3] = ["sm_90a", "sm_100a", "sm_120a"];

#[test]
fn every_kernel_compiles_for_every_target_without_spills() {
    if let Err(e) = nvrtc::ensure_loaded() {
        if std::env::var_os("BBC_REQUIRE_NVRTC").is_some() {
            panic!("BBC_REQUIRE_NVRTC is set but {e}");
        }
        eprintln!("skipped: {e}");
        return;
    }
    for kernel in templates::catalog() {
        let source = cuda::emit(&kernel);
        // A kernel using an architecture-specific instruction (wgmma) compiles for that one.
        let archs = ARCHS
            .into_iter()
            .filter(|&arch| cuda::required_arch(&kernel).is_none_or(|a| a == arch));
        for arch in archs {
            let built =
                spill_free::build(&kernel.name, &source, kernel.block_dim, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                built.ptx.contains(&format!(".entry {}", kernel.name)),
                "{} PTX for {arch} lacks its entry",
                kernel.name
            );
            let r = built
                .resources
                .as_ref()
                .unwrap_or_else(|| panic!("{} on {arch}: no ptxas report", kernel.name));
            assert!(!built.spills(), "{} spills on {arch}: {r:?}", kernel.name);
            assert!(r.warnings.is_empty(), "{} on {arch}: {:?}", kernel.name, r.warnings);
            let hint = built
                .min_blocks_per_sm
                .map_or(String::new(), |n| format!(" ({n} blocks an SM asked for)"));
            println!("{:<22} {arch:<8} {:>3} registers{hint}", kernel.name, r.registers);
        }
    }
}

#[test]
fn a_compile_error_carries_the_log_and_the_source() {
    if nvrtc::ensure_loaded().is_err() {
        return;
    }
    let err = nvrtc::compile_cubin(
        "broken",
        "extern \"C\" __global__ void broken() { undefined_thing(); }",
        "sm_90a",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("undefined_thing") && err.contains("--- source ---"),
        "{err}"
    );
}
