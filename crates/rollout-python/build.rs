//! Links the embedded interpreter's `libpython` by its directory (rpath), so this crate's
//! tests load the same Python it was compiled against without `LD_LIBRARY_PATH`, and tells
//! executables that link this crate where it is (`DEP_ROLLOUT_PYTHON_LIBDIR`; see the build
//! script of `crates/rollout`).

fn main() {
    let config = pyo3_build_config::get();
    if let Some(lib_dir) = config.lib_dir() {
        println!("cargo::rustc-link-arg=-Wl,-rpath,{lib_dir}");
        println!("cargo::metadata=libdir={lib_dir}");
    }
    println!("cargo::rerun-if-env-changed=PYO3_PYTHON");
}
