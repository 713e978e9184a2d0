//! An error as the command line prints it: the message, then each cause the message does not
//! already carry. Many of the workspace's errors (thiserror types) print their source inside
//! their own message and also name it as their source, so anyhow's `{:#}` said it twice
//! (`/x: No such file or directory (os error 2): No such file or directory (os error 2)`).

/// `e` and its causes on one line, each cause once.
pub fn error_report(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{path}: {source}")]
    struct Carries {
        path: String,
        #[source]
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("reading {path}")]
    struct Names {
        path: String,
        #[source]
        source: std::io::Error,
    }

    fn io() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::NotFound, "no such file")
    }

    #[test]
    fn each_cause_is_said_once() {
        let carried = anyhow::Error::new(Carries {
            path: "/x".into(),
            source: io(),
        });
        assert_eq!(error_report(&carried), "/x: no such file");
        let named = anyhow::Error::new(Names {
            path: "/y".into(),
            source: io(),
        });
        assert_eq!(error_report(&named), "reading /y: no such file");
        let context = anyhow::Error::new(io()).context("opening the model");
        assert_eq!(error_report(&context), "opening the model: no such file");
    }
}
