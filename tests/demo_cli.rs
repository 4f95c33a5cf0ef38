//! End-to-end: the `cudalloc` command's default job (the demo, small sizes) passes its own
//! verification; bad flags and environment values are one line and exit code 2.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

fn cudalloc() -> Command {
    let mut c = Command::new(common::cli());
    c.env("CUDALLOC_BACKEND", "host")
        .env("CUDALLOC_HOST_MEMORY", "256MiB");
    c
}

/// Runs `c`, asserts it succeeded (printing both outputs if not) and returns its stdout.
fn succeed(c: &mut Command) -> String {
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn demo_passes_its_own_verification() {
    let stdout = succeed(cudalloc().args([
        "demo",
        "--consumers",
        "2",
        "--storages",
        "12",
        "--max-size",
        "4MiB",
        "--seed",
        "7",
    ]));
    assert!(stdout.contains("verdict: ok"), "{stdout}");
    assert!(
        stdout.contains("12 storages plus a lazy clone of every third (16 to share)"),
        "the header counts what is shared: {stdout}"
    );
    assert!(
        stdout.contains("16 storages (12 + 4 lazy clones) shared with 2 consumer(s)"),
        "{stdout}"
    );
    assert!(!stdout.contains('\x1b'), "no escape codes on a pipe");
    assert!(
        stdout.contains("Allocated memory"),
        "the memory summary is printed: {stdout}"
    );
}

#[test]
fn bad_flags_and_environment_exit_with_code_2() {
    for (args, env) in [
        (vec!["demo", "--max-size", "12 parsecs"], None),
        (vec!["demo", "--consumers", "many"], None),
        (vec!["info"], Some(("CUDALLOC_HOST_MEMORY", "lots"))),
        // Before: "host device count 0 out of range", naming no variable.
        (vec!["info"], Some(("CUDALLOC_HOST_DEVICES", "0"))),
        (vec!["info"], Some(("CUDALLOC_HOST_MEMORY", "4096"))),
        (vec!["info"], Some(("CUDALLOC_BACKEND", "quantum"))),
        (vec!["info"], Some(("CUDALLOC_CONF", "foo:1"))),
        (vec!["demo"], Some(("CUDALLOC_CONF", "foo:1"))),
        (vec!["--consumers", "0"], None),
        // Before: "verdict: ok" having checked nothing.
        (vec!["demo", "--storages", "0"], None),
        // Before: exit code 1 ("demo failed: invalid configuration …").
        (
            vec!["demo", "--storages", "2"],
            Some(("CUDALLOC_HOST_MEMORY", "lots")),
        ),
        (vec!["info", "--storages", "3"], None),
        (vec!["--backend", "gpu", "info"], None),
        (vec!["replay", "--capacity", "lots", "x.json"], None),
        (vec!["replay", "/nonexistent/trace.json"], None),
        (vec!["replay", "Cargo.toml"], None),
        (
            vec!["replay", "--conf", "foo:1", "tests/data/tiny_trace.jsonl"],
            None,
        ),
    ] {
        let mut c = cudalloc();
        c.args(&args);
        if let Some((k, v)) = env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?} {env:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        // One line saying what is wrong (clap adds its pointer to --help after it).
        let first = stderr.lines().next().unwrap_or_default();
        assert!(!first.trim().is_empty(), "{args:?}: {stderr}");
        if let Some((variable, _)) = env {
            assert!(
                first.contains(variable),
                "the line names the variable {variable}: {stderr}"
            );
        }
        if args.contains(&"gpu") {
            assert!(
                !stderr.contains("CUDALLOC_BACKEND"),
                "the flag was wrong, not the variable: {stderr}"
            );
        }
    }
}

#[test]
fn demo_options_work_without_the_demo_command_and_info_prints_settings_not_debug_output() {
    let out = cudalloc()
        .args(["--consumers", "1", "--storages", "3", "--max-size", "64KiB"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 consumer(s)"), "{stdout}");
    let out = cudalloc()
        .arg("info")
        .env(
            "CUDALLOC_CONF",
            "max_split_size_mb:64,default_stream:dedicated",
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("  max_split_size_mb: 64\n"), "{stdout}");
    assert!(stdout.contains("  default_stream: dedicated"), "{stdout}");
    assert!(!stdout.contains("AllocatorConfig {"), "{stdout}");
}

#[test]
fn a_consumer_that_fails_to_start_or_connect_is_a_clear_error_and_cleans_up() {
    let script = std::env::temp_dir().join(format!("cudalloc-test-hang-{}.sh", std::process::id()));
    std::fs::write(&script, "#!/bin/sh\nexec sleep 30\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    for (exe, expect) in [
        ("/bin/false", "exited"),
        (script.to_str().unwrap(), "did not connect within 1.0 s"),
    ] {
        let child = cudalloc()
            .args(["demo", "--storages", "3", "--max-size", "64KiB"])
            .args(["--connect-timeout-s", "1", "--consumer-exe", exe])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let dir = std::env::temp_dir().join(format!("cudalloc-demo-{}", child.id()));
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(expect), "{exe}: {stderr}");
        assert!(!dir.exists(), "the socket folder {} is left", dir.display());
    }
    std::fs::remove_file(&script).unwrap();
}

/// Without `--svg` the command writes nothing (before, a plot landed in whatever folder it ran
/// in, named after the trace).
#[test]
fn replay_without_svg_writes_nothing_where_it_runs() {
    let trace =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny_trace.jsonl");
    let here = std::env::temp_dir().join(format!("cudalloc-replay-cwd-{}", std::process::id()));
    std::fs::create_dir_all(&here).unwrap();
    let stdout = succeed(cudalloc().current_dir(&here).arg("replay").arg(&trace));
    assert!(stdout.contains("plot: none"), "{stdout}");
    let left: Vec<_> = std::fs::read_dir(&here).unwrap().collect();
    assert!(
        left.is_empty(),
        "the replay wrote {left:?} into its working folder"
    );
    std::fs::remove_dir(&here).unwrap();
}

#[test]
fn replay_prints_a_row_per_configuration_and_writes_the_plot() {
    // The real ResNet-50 trace when the shared folder is there, else a small trace of ours.
    let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/traces/resnet50_training_v100.kineto.json.gz");
    let trace = if shared.exists() {
        shared
    } else {
        println!("replay on the ResNet-50 trace: skipped (../shared/traces/ is not here); a small trace instead");
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny_trace.jsonl")
    };
    let svg = std::env::temp_dir().join(format!("cudalloc-replay-{}.svg", std::process::id()));
    let stdout = succeed(
        cudalloc()
            .args([
                "replay",
                "--conf",
                "",
                "--conf",
                "expandable_segments:True",
                "--capacity",
                "32GiB",
                "--svg",
            ])
            .arg(&svg)
            .arg(&trace),
    );
    println!("{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("default (PyTorch's policy)")),
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("expandable_segments:True")),
        "{stdout}"
    );
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("reserved: expandable_segments:True"));
    std::fs::remove_file(&svg).unwrap();
}

#[test]
fn a_reader_that_goes_away_is_not_a_failure() {
    // `cudalloc info | head -1`: before, the command panicked on the broken pipe (exit 101).
    // The read end is closed before the command starts: every write meets a closed pipe.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = cudalloc()
        .arg("info")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
