//! genswap node agent.

fn main() {
    eprintln!("node-agent: not implemented yet");
    std::process::exit(2);
}
