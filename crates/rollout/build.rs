//! Links the embedded interpreter's `libpython` by its directory (rpath), so the built binary
//! loads the same Python it was compiled against without `LD_LIBRARY_PATH`. The directory
//! comes from `rollout-python`, the one crate that links Python.

fn main() {
    if let Ok(lib_dir) = std::env::var("DEP_ROLLOUT_PYTHON_LIBDIR") {
        println!("cargo::rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
    println!("cargo::rerun-if-env-changed=DEP_ROLLOUT_PYTHON_LIBDIR");
}
