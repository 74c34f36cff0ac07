//! The `flowhost` command line.

fn main() {
    println!("flowhost {}", env!("CARGO_PKG_VERSION"));
}
