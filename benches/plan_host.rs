//! The host's share of a GPU step: SmolLM2's H200 plan run on a device whose launches do
//! nothing (`NullDevice`), so what is timed is choosing each launch's kernel and resolving its
//! arguments from the plan — the work the CPU does per launch before the driver call, which a
//! prefill step (not replayed from a CUDA graph) pays for every one of its few hundred launches.
//! Prints µs per step and per launch for a decode step and a 128-token prefill step.
//! `cargo bench --bench plan_host`.

use codegen::Target;
use models::{LogitsFor, Model, ModelSpec};
use runtime::plan_exec::{DeviceArg, PlanDevice, PlanExecutor};
use runtime::Result;
use std::ops::Range;
use std::time::Instant;

/// Buffers are lengths; launches are counted, nothing runs.
#[derive(Default)]
struct NullDevice {
    launches: usize,
}

impl PlanDevice for NullDevice {
    type Buffer = usize;

    fn alloc(&mut self, bytes: usize) -> Result<usize> {
        Ok(bytes)
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<usize> {
        Ok(bytes.len())
    }

    fn write(&mut self, _: &usize, _: usize, _: &[u8]) -> Result<()> {
        Ok(())
    }

    fn read(&mut self, _: &usize, range: Range<usize>) -> Result<Vec<u8>> {
        Ok(vec![0; range.len()])
    }

    fn copy(&mut self, _: &usize, _: usize, _: &usize, _: usize, _: usize) -> Result<()> {
        Ok(())
    }

    fn launch(&mut self, _: &str, _: u32, _: u32, args: &[DeviceArg<'_, usize>]) -> Result<()> {
        std::hint::black_box(args);
        self.launches += 1;
        Ok(())
    }
}

fn main() {
    let known = bbc::fetch::known("smollm2").expect("smollm2 is a model bbc fetches");
    let path = bbc::fetch::ensure(known, true).expect("fetching the model");
    let model = Model::open(ModelSpec::for_weights(&path)).expect("opening the model");
    let target = Target::H200;
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let graph = passes::optimized(&graph, bbc::model_ref::cost_model(target)).unwrap();
    let plan = codegen::gpu::build(&graph, target, 128).unwrap();
    let backend = PlanExecutor::new(NullDevice::default(), plan, graph, &model.weights, &[], 1024).unwrap();
    println!(
        "{:>16} {:>12} {:>12} {:>14}",
        "step", "launches", "µs/step", "µs/launch"
    );
    for (what, tokens, reps) in [("decode", 1usize, 400), ("prefill 128", 128, 400)] {
        let ids: Vec<u32> = (0..tokens as u32).map(|i| 100 + 7 * i).collect();
        let before = backend.with_device(|d| d.launches).unwrap();
        let start = Instant::now();
        for _ in 0..reps {
            let mut seq = backend.new_sequence();
            backend.step(&mut seq, &ids).unwrap();
        }
        let seconds = start.elapsed().as_secs_f64() / reps as f64;
        let launches = (backend.with_device(|d| d.launches).unwrap() - before) / reps;
        println!(
            "{what:>16} {launches:>12} {:>12.1} {:>14.2}",
            seconds * 1e6,
            seconds * 1e6 / launches as f64
        );
    }
}
