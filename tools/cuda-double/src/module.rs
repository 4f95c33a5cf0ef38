//! Modules and kernels: `cuModuleLoadData` accepts PTX text (what NVRTC makes of `kernels/*.cu`),
//! reads each `.entry` and its parameter list, and binds each kernel by name to a native
//! implementation with the same effect (`kernels.rs`). A launch reads exactly as many parameters
//! as the PTX declares, of the sizes it declares, and the native implementation's expected
//! signature must match the PTX — so an argument list that drifts from the kernel source is
//! caught, not silently misread.

use crate::codes;
use crate::kernels::{native, Native};
use crate::report::{Checked, Fail};

/// A kernel's name and the byte size of each parameter, from PTX.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSig {
    /// The entry name.
    pub name: String,
    /// Parameter sizes in bytes.
    pub params: Vec<usize>,
}

/// A loaded module.
#[derive(Debug)]
pub struct Module {
    /// Its handle.
    pub handle: usize,
    /// The context it was loaded in.
    pub ctx: usize,
    /// Its kernels.
    pub entries: Vec<KernelSig>,
}

/// A kernel of a loaded module.
#[derive(Debug)]
pub struct Function {
    /// Its handle.
    pub handle: usize,
    /// The context of its module.
    pub ctx: usize,
    /// The context's epoch when it was looked up.
    pub epoch: u64,
    /// Its module's handle (unloading the module invalidates the function).
    pub module: usize,
    /// Its signature.
    pub sig: KernelSig,
    /// The native implementation, if the double has one.
    pub native: Option<&'static Native>,
}

impl Function {
    /// A function for `sig` (native implementation looked up by name).
    pub fn new(handle: usize, ctx: usize, epoch: u64, module: usize, sig: KernelSig) -> Function {
        Function {
            handle,
            ctx,
            epoch,
            module,
            native: native(&sig.name),
            sig,
        }
    }
}

fn bad_ptx(why: impl Into<String>) -> Fail {
    Fail::violation(codes::INVALID_PTX, why)
}

fn param_size(decl: &str) -> Checked<usize> {
    let words: Vec<&str> = decl.split_whitespace().collect();
    match words.as_slice() {
        [".param", ty, _name] => match *ty {
            ".u64" | ".s64" | ".b64" | ".f64" => Ok(8),
            ".u32" | ".s32" | ".b32" | ".f32" => Ok(4),
            ".u16" | ".s16" | ".b16" => Ok(2),
            ".u8" | ".s8" | ".b8" => Ok(1),
            other => Err(bad_ptx(format!("parameter type {other} in {decl:?}"))),
        },
        [".param", ".align", _, ".b8", array] => {
            let count = array
                .split_once('[')
                .and_then(|(_, rest)| rest.strip_suffix(']'))
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| bad_ptx(format!("parameter {decl:?}")))?;
            Ok(count)
        }
        _ => Err(bad_ptx(format!("cannot read parameter {decl:?}"))),
    }
}

/// The kernels of a PTX module.
pub fn parse_ptx(text: &str) -> Checked<Vec<KernelSig>> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    for directive in [".version", ".target"] {
        if !code.contains(directive) {
            return Err(bad_ptx(format!("the image is not PTX: no {directive}")));
        }
    }
    if !code.contains(".address_size 64") {
        return Err(bad_ptx("PTX without .address_size 64"));
    }
    let mut entries = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find(".entry") {
        rest = &rest[at + ".entry".len()..];
        let open = rest
            .find('(')
            .ok_or_else(|| bad_ptx("an .entry without a parameter list"))?;
        let name = rest[..open].trim().to_owned();
        let close = rest[open..]
            .find(')')
            .map(|c| open + c)
            .ok_or_else(|| bad_ptx(format!("unterminated parameter list of {name}")))?;
        let params = rest[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(param_size)
            .collect::<Checked<Vec<_>>>()?;
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(bad_ptx(format!("entry name {name:?}")));
        }
        entries.push(KernelSig { name, params });
        rest = &rest[close..];
    }
    if entries.is_empty() {
        return Err(bad_ptx("the module has no .entry"));
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_entries_and_parameter_sizes() {
        let ptx = ".version 8.8\n.target sm_52\n.address_size 64\n// .globl k\n\
                   .visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u32 k_param_1,\n\
                   \t.param .align 8 .b8 k_param_2[24]\n)\n{ ret; }\n.entry j()\n{ ret; }";
        let entries = parse_ptx(ptx).map_err(|f| f.message).unwrap_or_default();
        assert_eq!(
            entries,
            vec![
                KernelSig {
                    name: "k".into(),
                    params: vec![8, 4, 24]
                },
                KernelSig {
                    name: "j".into(),
                    params: vec![]
                }
            ]
        );
    }

    #[test]
    fn refuses_what_is_not_ptx() {
        assert!(parse_ptx("\x7fELF binary").is_err());
        assert!(parse_ptx(".version 8.8\n.target sm_52\n.address_size 32\n.entry k()").is_err());
    }
}
