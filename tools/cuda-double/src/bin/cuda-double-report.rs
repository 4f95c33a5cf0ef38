//! `cuda-double-report <report dir> <source file or folder>...`: the verdict of a run on the
//! double. Lists the calls of every entry point, and fails (exit 1) when any violation was
//! recorded or when an entry point the given sources call (`sys::cu…(` in Rust source) was never
//! called — or is not exported by the double at all.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use cuda_double::report::read_counts;

fn sources(path: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            sources(&entry?.path(), out)?;
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_owned());
    }
    Ok(())
}

/// Driver entry points called in `text` (`sys::cuName(`).
fn entry_points(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("sys::cu") {
        let name: String = rest[at + 5..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let after = &rest[at + 5 + name.len()..];
        if after.starts_with('(') {
            found.insert(name);
        }
        rest = &rest[at + 5..];
    }
    found
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .map(|t| t.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

fn main() -> ExitCode {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let Some((dir, paths)) = args.split_first() else {
        eprintln!("usage: cuda-double-report <report dir> <source file or folder>...");
        return ExitCode::from(2);
    };
    let counts = match read_counts(dir) {
        Ok(c) => c,
        Err(err) => {
            eprintln!("cannot read {}: {err}", dir.join("calls.bin").display());
            return ExitCode::from(2);
        }
    };
    let mut files = Vec::new();
    for p in paths {
        if let Err(err) = sources(p, &mut files) {
            eprintln!("cannot read {}: {err}", p.display());
            return ExitCode::from(2);
        }
    }
    let used: BTreeSet<String> = files
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| entry_points(&t))
        .collect();
    println!(
        "{:<32} {:>12} {:>12}  used by the sources",
        "entry point", "calls", "not success"
    );
    for (name, calls, failed) in &counts {
        let mark = if used.contains(*name) { "yes" } else { "-" };
        println!("{name:<32} {calls:>12} {failed:>12}  {mark}");
    }
    let mut failed = false;
    for name in &used {
        match counts.iter().find(|(n, _, _)| n == name) {
            None => {
                println!("FAIL: {name} is called by the sources but the double does not export it");
                failed = true;
            }
            Some((_, 0, _)) => {
                println!("FAIL: {name} is used by the sources but was never called in this run");
                failed = true;
            }
            Some(_) => {}
        }
    }
    let violations = lines(&dir.join("violations.log"));
    let rejected = lines(&dir.join("rejected.log"));
    let expected = lines(&dir.join("expected.log"));
    println!(
        "{} entry points used by the sources, {} violations, {} refused corrupt inputs, {} \
         violations committed on purpose by tests of prohibitions",
        used.len(),
        violations.len(),
        rejected.len(),
        expected.len()
    );
    for v in violations.iter().take(50) {
        println!("VIOLATION {v}");
    }
    failed |= !violations.is_empty();
    if failed {
        println!("cuda-double-report: FAILED");
        ExitCode::from(1)
    } else {
        println!("cuda-double-report: passed");
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::entry_points;

    #[test]
    fn finds_called_entry_points_only() {
        let text = "unsafe { sys::cuInit(0) }; sys::CUresult::X; sys::cuMemAlloc_v2(&mut p, n); \
                    use sys::cuda_thing;";
        let found: Vec<_> = entry_points(text).into_iter().collect();
        assert_eq!(found, ["cuInit", "cuMemAlloc_v2"]);
    }
}
