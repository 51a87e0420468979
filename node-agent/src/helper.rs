//! The arguments of `genswap-helper` (src/bin/genswap-helper.rs), read
//! without clap: the helper is kept small because one runs per generation.

use crate::listener_keeper::KEEPER_COMMAND;
use crate::logs::shim::{SHIM_COMMAND, ShimArgs};

/// What the helper was asked to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelperCommand {
    LogShim(ShimArgs),
    ListenerKeeper,
}

/// Reads `log-shim --max-size N --max-files N` or `listener-keeper`.
pub fn parse(args: &[String]) -> Result<HelperCommand, String> {
    let Some((command, rest)) = args.split_first() else {
        return Err(format!(
            "usage: genswap-helper {SHIM_COMMAND} --max-size BYTES --max-files N | {KEEPER_COMMAND}"
        ));
    };
    match command.as_str() {
        KEEPER_COMMAND if rest.is_empty() => Ok(HelperCommand::ListenerKeeper),
        KEEPER_COMMAND => Err(format!("{KEEPER_COMMAND} takes no arguments")),
        SHIM_COMMAND => {
            let (mut max_size, mut max_files) = (None, None);
            let mut words = rest.iter();
            while let Some(flag) = words.next() {
                let (name, value) = match flag.split_once('=') {
                    Some((name, value)) => (name, Some(value)),
                    None => (flag.as_str(), None),
                };
                if !matches!(name, "--max-size" | "--max-files") {
                    return Err(format!("{SHIM_COMMAND}: unknown argument {name}"));
                }
                let value = match value {
                    Some(value) => value,
                    None => words
                        .next()
                        .map(String::as_str)
                        .ok_or_else(|| format!("{name} needs a value"))?,
                };
                let number = |what| format!("{name} {value:?} is not {what}");
                match name {
                    "--max-size" => {
                        max_size = Some(value.parse::<u64>().map_err(|_| number("a byte count"))?)
                    }
                    _ => max_files = Some(value.parse::<u32>().map_err(|_| number("a count"))?),
                }
            }
            match (max_size, max_files) {
                (Some(max_size), Some(max_files)) => Ok(HelperCommand::LogShim(ShimArgs {
                    max_size,
                    max_files,
                })),
                _ => Err(format!("{SHIM_COMMAND} needs --max-size and --max-files")),
            }
        }
        other => Err(format!("unknown command {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn the_agents_arguments_read_as_the_agent_reads_them() {
        let shim = HelperCommand::LogShim(ShimArgs {
            max_size: 10_485_760,
            max_files: 5,
        });
        for line in [
            "log-shim --max-size 10485760 --max-files 5",
            "log-shim --max-files=5 --max-size=10485760",
        ] {
            assert_eq!(parse(&words(line)), Ok(shim.clone()), "{line}");
        }
        assert_eq!(
            parse(&words("listener-keeper")),
            Ok(HelperCommand::ListenerKeeper)
        );
    }

    #[test]
    fn wrong_arguments_are_refused_naming_what_is_wrong() {
        for (line, said) in [
            ("", "usage"),
            ("log-shim --max-size 10", "needs --max-size and --max-files"),
            ("log-shim --max-size", "--max-size needs a value"),
            (
                "log-shim --max-size ten --max-files 5",
                "\"ten\" is not a byte count",
            ),
            (
                "log-shim --max-size 1 --max-files -1",
                "\"-1\" is not a count",
            ),
            (
                "log-shim --max-size 1 --max-files 5 --color",
                "unknown argument --color",
            ),
            ("listener-keeper now", "takes no arguments"),
            ("run", "unknown command \"run\""),
        ] {
            let error = parse(&words(line)).expect_err(line);
            assert!(error.contains(said), "{line:?}: {error}");
        }
    }
}
