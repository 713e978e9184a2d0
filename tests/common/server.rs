//! `bbc serve` as a child process on 127.0.0.1, for the tests that speak to it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A running server, killed when dropped.
pub struct Server {
    child: Child,
    /// `host:port`.
    pub address: String,
}

impl Server {
    /// `bbc serve` with SmolLM2 as `smollm2` on a free port, and `extra` options.
    pub fn start(extra: &[&str]) -> Self {
        let model = super::real_model("smollm2");
        Self::start_model(
            model.to_str().unwrap(),
            &[&["--served-model-name", "smollm2"], extra].concat(),
        )
    }

    /// `bbc serve MODEL` on a free port, with `extra` options.
    pub fn start_model(model: &str, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bbc"))
            .arg("serve")
            .arg(model)
            .args(["--port", "0"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting bbc serve");
        let stderr = child.stderr.take().expect("stderr");
        // From here on, dropping `server` kills the process, panics included.
        let mut server = Self {
            child,
            address: String::new(),
        };
        let mut stderr = BufReader::new(stderr);
        let mut line = String::new();
        while server.address.is_empty() {
            line.clear();
            if stderr.read_line(&mut line).expect("reading the server's stderr") == 0 {
                panic!("bbc serve exited before listening");
            }
            if let Some((_, address)) = line.trim().rsplit_once("http://") {
                server.address = address.to_string();
            }
        }
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        server
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
