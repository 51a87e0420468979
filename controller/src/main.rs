//! genswap cluster controller binary.

use clap::Parser;

/// Command-line flags.
#[derive(Parser, Debug)]
#[command(name = "genswap-controller", version, about)]
struct Args {
    /// Watch one namespace; all namespaces when unset.
    #[arg(long, env = "GENSWAP_NAMESPACE")]
    namespace: Option<String>,
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, env = "GENSWAP_METRICS_ADDR", default_value = "127.0.0.1:8080")]
    metrics_addr: std::net::SocketAddr,
}

fn main() {
    let args = Args::parse();
    eprintln!("genswap-controller: not implemented yet ({args:?})");
    std::process::exit(2);
}
