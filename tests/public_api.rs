//! The public API, listed and compared with `docs/public-api.txt` (issue 22): growth of the
//! surface is a deliberate diff, never an accident. The listing is read from the source with `syn`
//! (stable Rust, no rustdoc JSON): every item reachable from the crate root through `pub mod` and
//! `pub use`, under each path it can be named by, with the public fields, variants and methods of
//! each type, the trait impls written or derived for it, and the feature that gates it.
//! `#[doc(hidden)]` items and `#[cfg(test)]` modules are not part of it.
//!
//! After a deliberate change: `CUDALLOC_BLESS_API=1 cargo test --test public_api` rewrites the
//! file; review its diff like any other.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use quote::ToTokens;
use syn::{Attribute, Fields, ImplItem, Item, TraitItem, UseTree, Visibility};

/// One module of the crate: its items and where it sits.
struct Module {
    items: Vec<Item>,
    /// Features every item of it needs (its `mod` lines' and ancestors' `cfg(feature)`).
    features: Vec<String>,
}

/// What a name resolves to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    /// Item `index` of module `module`.
    Def(Vec<String>, usize),
    Module(Vec<String>),
    /// A path outside the crate (`cudarc`, `std::…`).
    External(String),
}

struct Crate {
    modules: BTreeMap<Vec<String>, Module>,
}

fn is_test_only(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && {
            let text = a.meta.to_token_stream().to_string();
            text.contains("test") && !text.contains("not (test)") && !text.contains("feature")
        }
    })
}

fn is_hidden(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("doc") && a.meta.to_token_stream().to_string().contains("hidden")
    })
}

/// The features named by `cfg(feature = "…")` attributes (also inside `any`/`all`).
fn features_of(attrs: &[Attribute]) -> Vec<String> {
    let mut out = Vec::new();
    for a in attrs.iter().filter(|a| a.path().is_ident("cfg")) {
        let text = a.meta.to_token_stream().to_string();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("feature = \"") {
            rest = &rest[at + "feature = \"".len()..];
            if let Some(end) = rest.find('"') {
                out.push(rest[..end].to_owned());
                rest = &rest[end..];
            }
        }
    }
    out
}

fn load(src: &Path) -> Crate {
    let mut modules = BTreeMap::new();
    let root = syn::parse_file(&std::fs::read_to_string(src.join("lib.rs")).unwrap()).unwrap();
    add_module(
        &mut modules,
        Vec::new(),
        root.items,
        src.to_path_buf(),
        Vec::new(),
    );
    Crate { modules }
}

/// Adds module `path` with `items`; `dir` is where its `mod x;` files are.
fn add_module(
    modules: &mut BTreeMap<Vec<String>, Module>,
    path: Vec<String>,
    items: Vec<Item>,
    dir: PathBuf,
    features: Vec<String>,
) {
    for item in &items {
        let Item::Mod(m) = item else { continue };
        if is_test_only(&m.attrs) {
            continue;
        }
        let name = m.ident.to_string();
        let mut child = path.clone();
        child.push(name.clone());
        let mut child_features = features.clone();
        child_features.extend(features_of(&m.attrs));
        match &m.content {
            Some((_, inner)) => add_module(
                modules,
                child,
                inner.clone(),
                dir.join(&name),
                child_features,
            ),
            None => {
                let (file, child_dir) = if dir.join(format!("{name}.rs")).exists() {
                    (dir.join(format!("{name}.rs")), dir.join(&name))
                } else {
                    (dir.join(&name).join("mod.rs"), dir.join(&name))
                };
                let text = std::fs::read_to_string(&file)
                    .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                let parsed =
                    syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                add_module(modules, child, parsed.items, child_dir, child_features);
            }
        }
    }
    modules.insert(path, Module { items, features });
}

/// The name an item defines, if it defines one.
fn name_of(item: &Item) -> Option<String> {
    Some(match item {
        Item::Struct(i) => i.ident.to_string(),
        Item::Enum(i) => i.ident.to_string(),
        Item::Trait(i) => i.ident.to_string(),
        Item::Fn(i) => i.sig.ident.to_string(),
        Item::Const(i) => i.ident.to_string(),
        Item::Static(i) => i.ident.to_string(),
        Item::Type(i) => i.ident.to_string(),
        Item::Union(i) => i.ident.to_string(),
        Item::Macro(i) => i.ident.as_ref()?.to_string(),
        _ => return None,
    })
}

/// Every (name, path, is glob) a use tree brings in.
fn use_leaves(
    tree: &UseTree,
    prefix: &mut Vec<String>,
    out: &mut Vec<(String, Vec<String>, bool)>,
) {
    match tree {
        UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_leaves(&p.tree, prefix, out);
            prefix.pop();
        }
        UseTree::Name(n) => {
            let name = n.ident.to_string();
            let mut path = prefix.clone();
            if name == "self" {
                out.push((prefix.last().cloned().unwrap_or_default(), path, false));
            } else {
                path.push(name.clone());
                out.push((name, path, false));
            }
        }
        UseTree::Rename(r) => {
            let mut path = prefix.clone();
            if r.ident != "self" {
                path.push(r.ident.to_string());
            }
            out.push((r.rename.to_string(), path, false));
        }
        UseTree::Glob(_) => out.push((String::new(), prefix.clone(), true)),
        UseTree::Group(g) => {
            for t in &g.items {
                use_leaves(t, prefix, out);
            }
        }
    }
}

fn is_pub(vis: &Visibility) -> bool {
    matches!(vis, Visibility::Public(_))
}

impl Crate {
    /// What `name` means inside module `module` (its own items, child modules, `use`s).
    fn lookup(&self, module: &[String], name: &str, depth: usize) -> Option<Target> {
        let m = self.modules.get(module)?;
        let mut child = module.to_vec();
        child.push(name.to_owned());
        if self.modules.contains_key(&child) {
            return Some(Target::Module(child));
        }
        for (i, item) in m.items.iter().enumerate() {
            if name_of(item).as_deref() == Some(name) {
                return Some(Target::Def(module.to_vec(), i));
            }
        }
        for item in &m.items {
            let Item::Use(u) = item else { continue };
            let mut leaves = Vec::new();
            use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
            for (leaf, path, glob) in leaves {
                if glob {
                    if let Some(Target::Module(from)) = self.resolve(module, &path, depth + 1) {
                        if let Some(t) = self.lookup(&from, name, depth + 1) {
                            return Some(t);
                        }
                    }
                } else if leaf == name {
                    return self.resolve(module, &path, depth + 1);
                }
            }
        }
        None
    }

    /// Resolves a path written in module `module`.
    fn resolve(&self, module: &[String], path: &[String], depth: usize) -> Option<Target> {
        if depth > 32 || path.is_empty() {
            return None;
        }
        let (mut at, rest) = match path[0].as_str() {
            "crate" => (Target::Module(Vec::new()), &path[1..]),
            "self" => (Target::Module(module.to_vec()), &path[1..]),
            "super" => (
                Target::Module(module[..module.len().saturating_sub(1)].to_vec()),
                &path[1..],
            ),
            first => match self.lookup(module, first, depth) {
                Some(t) => (t, &path[1..]),
                None => return Some(Target::External(path.join("::"))),
            },
        };
        let mut rest = rest;
        while let Some(seg) = rest.first() {
            if seg == "super" {
                if let Target::Module(m) = &at {
                    at = Target::Module(m[..m.len().saturating_sub(1)].to_vec());
                    rest = &rest[1..];
                    continue;
                }
            }
            match &at {
                Target::Module(m) => at = self.lookup(m, seg, depth)?,
                // A variant or an associated item: the listing names the type.
                Target::Def(..) | Target::External(_) => break,
            }
            rest = &rest[1..];
        }
        Some(at)
    }

    fn item(&self, module: &[String], index: usize) -> &Item {
        &self.modules[module].items[index]
    }

    /// The impl blocks of the crate: (module, item) of each.
    fn impls(&self) -> Vec<(&[String], &syn::ItemImpl)> {
        let mut out = Vec::new();
        for (path, m) in &self.modules {
            for item in &m.items {
                if let Item::Impl(i) = item {
                    if !is_test_only(&i.attrs) {
                        out.push((path.as_slice(), i));
                    }
                }
            }
        }
        out
    }
}

/// Tokens as compact text: `(&self, device: usize) -> Result<DataPtr>`.
fn text(tokens: &impl ToTokens) -> String {
    let spaced = tokens.to_token_stream().to_string();
    let words: Vec<&str> = spaced.split_whitespace().collect();
    let mut out = String::new();
    for (i, w) in words.iter().enumerate() {
        let prev = if i == 0 { "" } else { words[i - 1] };
        let first = w.chars().next().unwrap_or(' ');
        let glue_before = matches!(
            first,
            ',' | ')' | '>' | ']' | ';' | ':' | '?' | '.' | '(' | '<' | '['
        ) && !(matches!(first, '(' | '[')
            && matches!(prev, "," | "->" | "=" | "|" | "dyn" | "impl"))
            && !(first == '<' && prev.is_empty());
        let glue_after_prev =
            prev.ends_with(['(', '<', '[', '&', '#', '\'', '!', '*']) || prev.ends_with("::");
        if i > 0 && !glue_before && !glue_after_prev {
            out.push(' ');
        }
        out.push_str(w);
    }
    out
}

struct Listing<'a> {
    krate: &'a Crate,
    lines: BTreeSet<String>,
    seen: BTreeSet<(Vec<String>, Vec<String>)>,
}

impl Listing<'_> {
    fn tag(features: &[String]) -> String {
        let set: BTreeSet<&String> = features.iter().collect();
        if set.is_empty() {
            String::new()
        } else {
            format!(
                " [feature {}]",
                set.into_iter().cloned().collect::<Vec<_>>().join(", ")
            )
        }
    }

    /// Lists module `module`'s public items under the exported path `public`.
    fn module(&mut self, module: &[String], public: &[String], features: &[String]) {
        if !self.seen.insert((module.to_vec(), public.to_vec())) {
            return;
        }
        let krate = self.krate;
        let m = &krate.modules[module];
        for (i, item) in m.items.iter().enumerate() {
            match item {
                Item::Mod(x) if is_pub(&x.vis) && !is_hidden(&x.attrs) => {
                    let mut child = module.to_vec();
                    child.push(x.ident.to_string());
                    if !krate.modules.contains_key(&child) {
                        continue;
                    }
                    let mut path = public.to_vec();
                    path.push(x.ident.to_string());
                    let mut f = features.to_vec();
                    f.extend(features_of(&x.attrs));
                    self.lines
                        .insert(format!("mod {}{}", path.join("::"), Self::tag(&f)));
                    self.module(&child, &path, &f);
                }
                Item::Use(u) if is_pub(&u.vis) && !is_hidden(&u.attrs) => {
                    let mut f = features.to_vec();
                    f.extend(features_of(&u.attrs));
                    let mut leaves = Vec::new();
                    use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
                    for (name, path, glob) in leaves {
                        match krate.resolve(module, &path, 0) {
                            Some(Target::Module(from)) if glob => self.module(&from, public, &f),
                            Some(Target::Module(from)) => {
                                let mut at = public.to_vec();
                                at.push(name.clone());
                                self.lines.insert(format!(
                                    "mod {}{}",
                                    at.join("::"),
                                    Self::tag(&f)
                                ));
                                self.module(&from, &at, &f);
                            }
                            Some(Target::Def(dm, di)) => {
                                let mut at = public.to_vec();
                                at.push(name);
                                self.def(&dm, di, &at, &f);
                            }
                            Some(Target::External(p)) => {
                                let mut at = public.to_vec();
                                at.push(name);
                                self.lines.insert(format!(
                                    "pub use {} = {p}{}",
                                    at.join("::"),
                                    Self::tag(&f)
                                ));
                            }
                            None => panic!("unresolved pub use {} in {module:?}", path.join("::")),
                        }
                    }
                }
                _ => {
                    let vis_pub = match item {
                        Item::Struct(x) => is_pub(&x.vis) && !is_hidden(&x.attrs),
                        Item::Enum(x) => is_pub(&x.vis) && !is_hidden(&x.attrs),
                        Item::Trait(x) => is_pub(&x.vis) && !is_hidden(&x.attrs),
                        Item::Fn(x) => is_pub(&x.vis) && !is_hidden(&x.attrs),
                        Item::Const(x) => is_pub(&x.vis) && !is_hidden(&x.attrs),
                        Item::Static(x) => is_pub(&x.vis) && !is_hidden(&x.attrs),
                        Item::Type(x) => is_pub(&x.vis) && !is_hidden(&x.attrs),
                        Item::Union(x) => is_pub(&x.vis) && !is_hidden(&x.attrs),
                        _ => false,
                    };
                    if vis_pub {
                        let mut at = public.to_vec();
                        at.push(name_of(item).unwrap());
                        self.def(module, i, &at, features);
                    }
                }
            }
        }
    }

    /// Lists the definition `index` of `module` under `public`.
    fn def(&mut self, module: &[String], index: usize, public: &[String], features: &[String]) {
        let krate = self.krate;
        let item = krate.item(module, index);
        let path = public.join("::");
        let attrs: &[Attribute] = match item {
            Item::Struct(x) => &x.attrs,
            Item::Enum(x) => &x.attrs,
            Item::Trait(x) => &x.attrs,
            Item::Fn(x) => &x.attrs,
            Item::Const(x) => &x.attrs,
            Item::Static(x) => &x.attrs,
            Item::Type(x) => &x.attrs,
            Item::Union(x) => &x.attrs,
            _ => &[],
        };
        let mut f = features.to_vec();
        f.extend(features_of(attrs));
        f.extend(krate.modules[module].features.iter().cloned());
        let tag = Self::tag(&f);
        let non_exhaustive = attrs.iter().any(|a| a.path().is_ident("non_exhaustive"));
        let ne = if non_exhaustive {
            " #[non_exhaustive]"
        } else {
            ""
        };
        match item {
            Item::Struct(x) => {
                let private = x.fields.iter().any(|fl| !is_pub(&fl.vis));
                let shape = match (&x.fields, private) {
                    (Fields::Unit, _) => " (unit)",
                    (_, true) => " (private fields)",
                    _ => "",
                };
                self.lines.insert(format!(
                    "struct {path}{}{shape}{ne}{tag}",
                    text(&x.generics)
                ));
                for (n, fl) in x.fields.iter().enumerate() {
                    if is_pub(&fl.vis) {
                        let name = fl.ident.as_ref().map_or(n.to_string(), ToString::to_string);
                        self.lines
                            .insert(format!("field {path}::{name}: {}{tag}", text(&fl.ty)));
                    }
                }
            }
            Item::Enum(x) => {
                self.lines
                    .insert(format!("enum {path}{}{ne}{tag}", text(&x.generics)));
                for v in &x.variants {
                    let fields = match &v.fields {
                        Fields::Unit => String::new(),
                        other => text(other),
                    };
                    self.lines
                        .insert(format!("variant {path}::{}{fields}{tag}", v.ident));
                }
            }
            Item::Trait(x) => {
                let unsafety = if x.unsafety.is_some() { "unsafe " } else { "" };
                self.lines
                    .insert(format!("{unsafety}trait {path}{}{tag}", text(&x.generics)));
                for ti in &x.items {
                    match ti {
                        TraitItem::Fn(m) => {
                            let provided = if m.default.is_some() {
                                " (provided)"
                            } else {
                                ""
                            };
                            self.lines.insert(format!(
                                "trait fn {path}::{}{provided}{tag}",
                                text(&m.sig)
                                    .split_once("fn ")
                                    .map_or(String::new(), |(_, r)| r.to_owned())
                            ));
                        }
                        TraitItem::Type(t) => {
                            self.lines
                                .insert(format!("trait type {path}::{}{tag}", t.ident));
                        }
                        TraitItem::Const(c) => {
                            self.lines.insert(format!(
                                "trait const {path}::{}: {}{tag}",
                                c.ident,
                                text(&c.ty)
                            ));
                        }
                        _ => {}
                    }
                }
            }
            Item::Fn(x) => {
                self.lines.insert(format!(
                    "fn {path}{}{tag}",
                    text(&x.sig)
                        .split_once(&format!("fn {}", x.sig.ident))
                        .map_or(String::new(), |(_, rest)| rest.trim_start().to_owned())
                ));
            }
            Item::Const(x) => {
                self.lines
                    .insert(format!("const {path}: {}{tag}", text(&x.ty)));
            }
            Item::Static(x) => {
                self.lines
                    .insert(format!("static {path}: {}{tag}", text(&x.ty)));
            }
            Item::Type(x) => {
                self.lines
                    .insert(format!("type {path} = {}{tag}", text(&x.ty)));
            }
            Item::Union(x) => {
                self.lines.insert(format!("union {path}{tag}"));
                let _ = x;
            }
            _ => {}
        }
        if matches!(item, Item::Struct(_) | Item::Enum(_) | Item::Union(_)) {
            self.members(module, index, &path, &tag, attrs);
        }
    }

    /// Inherent methods and trait impls (written or derived) of a type.
    fn members(
        &mut self,
        module: &[String],
        index: usize,
        path: &str,
        tag: &str,
        attrs: &[Attribute],
    ) {
        for a in attrs.iter().filter(|a| a.path().is_ident("derive")) {
            let text = a.meta.to_token_stream().to_string();
            let inner = text
                .trim_start_matches("derive")
                .trim()
                .trim_start_matches('(')
                .trim_end_matches(')');
            for d in inner.split(',') {
                let d = d.trim().rsplit("::").next().unwrap().trim();
                if !d.is_empty() {
                    self.lines
                        .insert(format!("impl {d} for {path} (derived){tag}"));
                }
            }
        }
        let target = Target::Def(module.to_vec(), index);
        for (impl_module, imp) in self.krate.impls() {
            let syn::Type::Path(ty) = &*imp.self_ty else {
                continue;
            };
            let segs: Vec<String> = ty
                .path
                .segments
                .iter()
                .map(|s| s.ident.to_string())
                .collect();
            if self.krate.resolve(impl_module, &segs, 0) != Some(target.clone()) {
                continue;
            }
            let mut f: Vec<String> = features_of(&imp.attrs);
            f.extend(self.krate.modules[impl_module].features.iter().cloned());
            let extra = if f.is_empty() {
                tag.to_owned()
            } else {
                let mut all: Vec<String> = tag
                    .trim_start_matches(" [feature ")
                    .trim_end_matches(']')
                    .split(", ")
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect();
                all.extend(f);
                Self::tag(&all)
            };
            match &imp.trait_ {
                Some((neg, trait_path, _)) => {
                    let not = if neg.is_some() { "!" } else { "" };
                    let name = trait_path.segments.last().map(text).unwrap_or_default();
                    let unsafety = if imp.unsafety.is_some() {
                        "unsafe "
                    } else {
                        ""
                    };
                    self.lines
                        .insert(format!("{unsafety}impl {not}{name} for {path}{extra}"));
                }
                None => {
                    for ii in &imp.items {
                        match ii {
                            ImplItem::Fn(m) if is_pub(&m.vis) && !is_hidden(&m.attrs) => {
                                let mut mf: Vec<String> = features_of(&m.attrs);
                                if !mf.is_empty() {
                                    mf.extend(
                                        extra
                                            .trim_start_matches(" [feature ")
                                            .trim_end_matches(']')
                                            .split(", ")
                                            .filter(|s| !s.is_empty())
                                            .map(str::to_owned),
                                    );
                                }
                                let t = if mf.is_empty() {
                                    extra.clone()
                                } else {
                                    Self::tag(&mf)
                                };
                                let sig = text(&m.sig);
                                let after = sig
                                    .split_once(&format!("fn {}", m.sig.ident))
                                    .map_or(sig.clone(), |(_, rest)| rest.trim_start().to_owned());
                                let unsafety = if m.sig.unsafety.is_some() {
                                    "unsafe "
                                } else {
                                    ""
                                };
                                self.lines.insert(format!(
                                    "{unsafety}fn {path}::{}{after}{t}",
                                    m.sig.ident
                                ));
                            }
                            ImplItem::Const(c) if is_pub(&c.vis) && !is_hidden(&c.attrs) => {
                                self.lines.insert(format!(
                                    "const {path}::{}: {}{extra}",
                                    c.ident,
                                    text(&c.ty)
                                ));
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
    }
}

fn listing() -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let krate = load(&src);
    let mut listing = Listing {
        krate: &krate,
        lines: BTreeSet::new(),
        seen: BTreeSet::new(),
    };
    listing.module(&[], &["cudalloc".to_owned()], &[]);
    listing.lines.into_iter().collect()
}

/// Items of a listing: every line but trait impls.
fn count_items(lines: &[String]) -> usize {
    lines
        .iter()
        .filter(|l| !l.starts_with("impl ") && !l.starts_with("unsafe impl "))
        .count()
}

#[test]
fn the_public_api_is_the_checked_in_listing() {
    let lines = listing();
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/public-api.txt");
    let items = count_items(&lines);
    let header = format!(
        "# The public API of cudalloc, as tests/public_api.rs lists it: {items} items (every line but\n\
         # trait impls), {} trait impls. Regenerate with CUDALLOC_BLESS_API=1 cargo test --test public_api.\n",
        lines.len() - items
    );
    let text = format!("{header}{}\n", lines.join("\n"));
    if std::env::var_os("CUDALLOC_BLESS_API").is_some() {
        std::fs::write(&file, &text).unwrap();
        println!("public API: wrote {} ({items} items)", file.display());
        return;
    }
    let checked_in = std::fs::read_to_string(&file).unwrap_or_default();
    let old: BTreeSet<&str> = checked_in
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let new: BTreeSet<&str> = lines.iter().map(String::as_str).collect();
    let added: Vec<&&str> = new.difference(&old).collect();
    let removed: Vec<&&str> = old.difference(&new).collect();
    assert!(
        added.is_empty() && removed.is_empty(),
        "the public API differs from docs/public-api.txt (run CUDALLOC_BLESS_API=1 cargo test \
         --test public_api after a deliberate change):\nadded:\n  {}\nremoved:\n  {}",
        added
            .iter()
            .take(60)
            .map(|s| **s)
            .collect::<Vec<_>>()
            .join("\n  "),
        removed
            .iter()
            .take(60)
            .map(|s| **s)
            .collect::<Vec<_>>()
            .join("\n  ")
    );
    println!("public API: {items} items, as checked in");
}

#[test]
fn the_lister_follows_re_exports_and_sees_members() {
    let lines = listing();
    let has = |prefix: &str| lines.iter().any(|l| l.starts_with(prefix));
    assert!(
        has("struct cudalloc::Storage"),
        "a root re-export is listed"
    );
    assert!(
        has("fn cudalloc::Runtime::allocate("),
        "inherent methods are listed"
    );
    assert!(
        has("impl Debug for cudalloc::Storage"),
        "derived or written impls are listed"
    );
    assert!(has("enum cudalloc::ErrorKind"), "enums are listed");
    assert!(has("variant cudalloc::ErrorKind::"), "variants are listed");
    assert!(
        !lines.iter().any(|l| l.contains("::tests::")),
        "test modules are not part of the API"
    );
}

/// Whether `name` names a count of bytes or a byte position.
fn names_bytes(name: &str) -> bool {
    matches!(
        name,
        "len" | "size" | "nbytes" | "bytes" | "offset" | "capacity"
    ) || name.ends_with("_offset")
        || name.ends_with("_bytes")
        || name.ends_with("_size")
}

/// Every `name: Type` pair of a listing line (parameters and fields), types cut at `,` / `)`
/// outside angle brackets.
fn typed_names(line: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let bytes: Vec<char> = line.chars().collect();
    let mut i = 0;
    while let Some(colon) = bytes[i..].iter().position(|&c| c == ':').map(|p| p + i) {
        // `::` is a path, not a type annotation.
        if bytes.get(colon + 1) == Some(&':') || (colon > 0 && bytes[colon - 1] == ':') {
            i = colon + 2;
            continue;
        }
        let start = bytes[..colon]
            .iter()
            .rposition(|c| !(c.is_alphanumeric() || *c == '_'))
            .map_or(0, |p| p + 1);
        let name: String = bytes[start..colon].iter().collect();
        let mut depth = 0i32;
        let mut end = colon + 1;
        while end < bytes.len() {
            match bytes[end] {
                '<' | '(' | '[' => depth += 1,
                '>' | ']' => depth -= 1,
                ')' if depth == 0 => break,
                ')' => depth -= 1,
                ',' if depth == 0 => break,
                _ => {}
            }
            end += 1;
        }
        let ty: String = bytes[colon + 1..end].iter().collect::<String>();
        pairs.push((name, ty.trim().to_owned()));
        i = colon + 1;
    }
    pairs
}

/// One integer type for bytes at the public door (issue 47): every parameter and field that
/// names a count of bytes or a byte position is a `u64`, and every byte range a `Range<u64>` —
/// device memory, pinned memory and a host kernel's view of device memory alike. Element
/// positions (`Range<usize>` of a typed view or operand, as cudarc and Rust slices count them)
/// and counts of things (`usize`) are not bytes. Before: a pinned buffer was `usize` bytes long
/// and `u64` bytes large, a host kernel's offsets `usize`, a launch's shared memory `u32`.
#[test]
fn byte_sizes_and_offsets_are_u64_at_the_public_door() {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/public-api.txt"))
            .unwrap();
    const INTEGERS: [&str; 10] = [
        "usize", "isize", "u8", "u16", "u32", "i8", "i16", "i32", "i64", "u128",
    ];
    // PyTorch's own key: -1 when no split limit is set.
    const EXEMPT: [&str; 1] = ["field cudalloc::stats::DeviceStats::max_split_size: i64"];
    let element_ranges = ["::view<", "::view_mut<", "::elements("];
    let mut wrong = Vec::new();
    let mut checked = 0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        if EXEMPT.iter().any(|e| line.starts_with(e)) {
            continue;
        }
        for (name, ty) in typed_names(line) {
            if names_bytes(&name) && INTEGERS.contains(&ty.as_str()) {
                wrong.push(format!("{line}\n    {name}: {ty}"));
            }
            if ty.starts_with("Range<") {
                checked += 1;
                let elements = element_ranges.iter().any(|e| line.contains(e));
                if ty != "Range<u64>" && !elements {
                    wrong.push(format!(
                        "{line}\n    {name}: {ty} (a byte range is Range<u64>)"
                    ));
                }
            }
            checked += usize::from(names_bytes(&name));
        }
        // Methods that return a size of bytes.
        let returns_bytes = ["::len(", "::nbytes(", "::capacity("]
            .iter()
            .any(|m| line.starts_with("fn ") && line.contains(m));
        if returns_bytes {
            checked += 1;
            let ret = line.rsplit("->").next().unwrap_or("").trim();
            if INTEGERS.iter().any(|t| ret.starts_with(t)) {
                wrong.push(format!("{line}\n    returns {ret}"));
            }
        }
    }
    assert!(
        checked > 60,
        "the scan found only {checked} byte names: is the listing read?"
    );
    assert!(
        wrong.is_empty(),
        "byte counts and positions that are not u64:\n{}",
        wrong.join("\n")
    );
    println!("{checked} byte sizes, offsets and ranges at the public door: all u64");
}
