//! Links the embedded interpreter's `libpython` by its directory (rpath), so the built binary
//! loads the same Python it was compiled against without `LD_LIBRARY_PATH`.

fn main() {
    let config = pyo3_build_config::get();
    if let Some(lib_dir) = config.lib_dir() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
}
