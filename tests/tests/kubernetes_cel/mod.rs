//! A type check of CEL expressions against the functions the Kubernetes
//! API server declares, for the expressions genswap ships (CRD
//! `x-kubernetes-validations`, the chart's admission policy).
//!
//! Why it exists: kube's client-side CEL evaluator runs an expression with
//! its own, looser function set. It ran `quantity(x).sign()` happily, while
//! every API server refused to install a CRD with it, because Kubernetes
//! declares `sign` as a global function of a quantity only. Evaluation
//! checks behaviour; this checks what the server compiles.
//!
//! The expression is parsed by the `cel` crate's real CEL parser (macros
//! expanded as cel-go expands them); the checker then gives every node a
//! type from the variables (`self` typed from the schema node, `object`,
//! `request`, ...) and resolves every call against [`declarations`] as
//! cel-go's checker does: the function must exist in the call style used,
//! with an overload whose parameter types accept the arguments', and the
//! library that declares it must be enabled in the target version.
//!
//! What it cannot catch, and where that is covered instead:
//! - the rule cost budget (estimated cost of comprehensions over lists or
//!   strings without `maxItems`/`maxLength`): not estimated here;
//! - a function the table lacks or mistypes: the table is hand-built from
//!   the sources named in `declarations.rs`; a real API server (`e2e/`,
//!   the install story in docs/INSTALL.md) remains the final word;
//! - semantics: covered by the client-side evaluation tests (crds/tests/cel.rs,
//!   tests/tests/chart_admission.rs).

#![allow(dead_code)] // Each test binary uses its own part of this module.

pub mod declarations;
pub mod types;

use std::collections::BTreeMap;

use cel::common::ast::{CallExpr, EntryExpr, Expr, IdedExpr, LiteralValue};
use cel::parser::Parser;

use declarations::{Library, Overload};
use types::{Type, assignable, list, map, optional, substitute};

/// The Kubernetes version whose new-expression environment is checked
/// against: 1.31, the oldest the README supports, compiles new expressions
/// with the libraries of its compatibility version, 1.30
/// (environment.DefaultCompatibilityVersion in v1.31).
pub const TARGET_COMPATIBILITY_VERSION: (u32, u32) = (1, 30);

/// The variables an expression may read, and the functions it may call.
pub struct Environment {
    variables: BTreeMap<String, Type>,
    overloads: Vec<Overload>,
}

impl Environment {
    /// The base environment of `version` with no variables.
    pub fn kubernetes(version: (u32, u32)) -> Self {
        Self::from_libraries(
            declarations::libraries()
                .into_iter()
                .filter(|library| library.introduced <= version),
        )
    }

    fn from_libraries(libraries: impl Iterator<Item = Library>) -> Self {
        Self {
            variables: BTreeMap::new(),
            overloads: libraries.flat_map(|library| library.overloads).collect(),
        }
    }

    pub fn with_variable(mut self, name: &str, ty: Type) -> Self {
        self.variables.insert(name.to_string(), ty);
        self
    }

    /// Parses and type-checks `source`; the type of its value, or the
    /// error the API server would report (in cel-go's words).
    pub fn check(&self, source: &str) -> Result<Type, String> {
        let parsed = Parser::new()
            .enable_optional_syntax(true)
            .parse(source)
            .map_err(|errors| errors.to_string())?;
        let mut checker = Checker {
            env: self,
            scopes: Vec::new(),
        };
        checker.expr(&parsed)
    }

    /// Like [`check`](Self::check), and the value must be of type `want`.
    pub fn check_returns(&self, source: &str, want: &Type) -> Result<(), String> {
        let got = self.check(source)?;
        if assignable(want, &got, &mut BTreeMap::new()) {
            Ok(())
        } else {
            Err(format!(
                "expression must evaluate to {want}, but it is {got}"
            ))
        }
    }
}

struct Checker<'e> {
    env: &'e Environment,
    /// Comprehension variables, innermost last.
    scopes: Vec<(String, Type)>,
}

impl Checker<'_> {
    fn expr(&mut self, node: &IdedExpr) -> Result<Type, String> {
        match &node.expr {
            Expr::Unspecified => Err("an empty expression".into()),
            Expr::Literal(literal) => Ok(literal_type(literal)),
            Expr::Ident(name) => self.ident(name),
            Expr::Select(select) => {
                if let Some(ty) = self.qualified_variable(node) {
                    return Ok(ty);
                }
                let operand = self.expr(&select.operand)?;
                let field = field_type(&operand, &select.field)?;
                Ok(if select.test { Type::Bool } else { field })
            }
            Expr::Call(call) => self.call(call),
            Expr::List(elements) => {
                let mut element = Type::Dyn;
                for item in &elements.elements {
                    let ty = self.expr(item)?;
                    element = join(&element, &ty).ok_or_else(|| {
                        format!("expected type '{element}' but found '{ty}' (list elements must be of one type)")
                    })?;
                }
                Ok(list(element))
            }
            Expr::Map(entries) => {
                let (mut key, mut value) = (Type::Dyn, Type::Dyn);
                for entry in &entries.entries {
                    let EntryExpr::MapEntry(entry) = &entry.expr else {
                        return Err("a struct field in a map literal".into());
                    };
                    let k = self.expr(&entry.key)?;
                    let v = self.expr(&entry.value)?;
                    key = join(&key, &k)
                        .ok_or_else(|| format!("map keys of types '{key}' and '{k}'"))?;
                    value = join(&value, &v)
                        .ok_or_else(|| format!("map values of types '{value}' and '{v}'"))?;
                }
                Ok(map(key, value))
            }
            Expr::Struct(object) => Err(format!(
                "undeclared reference to '{}' (no message types are declared)",
                object.type_name
            )),
            Expr::Comprehension(comprehension) => {
                let range = self.expr(&comprehension.iter_range)?;
                let (first, second) = match &range {
                    Type::List(element) => (Type::Int, (**element).clone()),
                    Type::Map(key, value) => ((**key).clone(), (**value).clone()),
                    Type::Dyn => (Type::Dyn, Type::Dyn),
                    other => {
                        return Err(format!(
                            "expression of type '{other}' cannot be range of a comprehension (must be list, map, or dynamic)"
                        ));
                    }
                };
                let bindings: Vec<(String, Type)> = match &comprehension.iter_var2 {
                    Some(var2) => vec![
                        (comprehension.iter_var.clone(), first),
                        (var2.clone(), second),
                    ],
                    // One variable: a list's element, a map's key.
                    None => vec![(
                        comprehension.iter_var.clone(),
                        if matches!(range, Type::List(_)) {
                            second
                        } else {
                            first
                        },
                    )],
                };
                let init = self.expr(&comprehension.accu_init)?;
                let depth = self.scopes.len();
                self.scopes
                    .push((comprehension.accu_var.clone(), init.clone()));
                self.scopes.extend(bindings);
                let checked = (|| {
                    let condition = self.expr(&comprehension.loop_cond)?;
                    if !assignable(&Type::Bool, &condition, &mut BTreeMap::new()) {
                        return Err(format!("a loop condition of type '{condition}'"));
                    }
                    let step = self.expr(&comprehension.loop_step)?;
                    let accumulator = join(&init, &step).ok_or_else(|| {
                        format!("a comprehension step of type '{step}' for an accumulator of type '{init}'")
                    })?;
                    self.scopes[depth].1 = accumulator;
                    Ok(())
                })();
                self.scopes.truncate(depth + 1);
                let result = checked.and_then(|()| self.expr(&comprehension.result));
                self.scopes.truncate(depth);
                result
            }
        }
    }

    fn ident(&self, name: &str) -> Result<Type, String> {
        if let Some((_, ty)) = self.scopes.iter().rev().find(|(var, _)| var == name) {
            return Ok(ty.clone());
        }
        if let Some(ty) = self.env.variables.get(name) {
            return Ok(ty.clone());
        }
        match name {
            "bool" | "int" | "uint" | "double" | "string" | "bytes" | "list" | "map"
            | "null_type" | "type" => Ok(Type::Kind),
            _ => Err(format!(
                "undeclared reference to '{name}' (in container '')"
            )),
        }
    }

    /// `a.b.c` as one dotted name, when it is a chain of plain selections
    /// from an identifier that is not a variable in scope.
    fn dotted_name(&self, node: &IdedExpr) -> Option<String> {
        match &node.expr {
            Expr::Ident(name) => {
                let shadowed = self.scopes.iter().any(|(var, _)| var == name)
                    || self.env.variables.contains_key(name);
                (!shadowed).then(|| name.clone())
            }
            Expr::Select(select) if !select.test => Some(format!(
                "{}.{}",
                self.dotted_name(&select.operand)?,
                select.field
            )),
            _ => None,
        }
    }

    /// A variable declared under a dotted name (`authorizer.requestResource`).
    fn qualified_variable(&self, node: &IdedExpr) -> Option<Type> {
        let Expr::Select(select) = &node.expr else {
            return None;
        };
        let Expr::Ident(root) = &select.operand.expr else {
            return None;
        };
        self.env
            .variables
            .get(&format!("{root}.{}", select.field))
            .cloned()
    }

    fn call(&mut self, call: &CallExpr) -> Result<Type, String> {
        // `x.?field`: the field's type, made optional (OptionalTypes, 1.28).
        if call.func_name == "_?._"
            && self.declared("_?._")
            && let [operand, field] = call.args.as_slice()
            && let Expr::Literal(LiteralValue::String(field)) = &field.expr
        {
            let operand = self.expr(operand)?;
            return Ok(optional(field_type(&operand, field.inner())?));
        }
        // `optional.of(x)`, `sets.contains(a, b)`: a namespaced global
        // function, parsed as a member call on an identifier.
        if let Some(target) = &call.target
            && let Some(namespace) = self.dotted_name(target)
        {
            let qualified = format!("{namespace}.{}", call.func_name);
            if self.declared(&qualified) {
                let args = self.args(&call.args)?;
                return self.resolve(&qualified, false, &args);
            }
        }
        let mut args = Vec::new();
        if let Some(target) = &call.target {
            args.push(self.expr(target)?);
        }
        args.extend(self.args(&call.args)?);
        self.resolve(&call.func_name, call.target.is_some(), &args)
    }

    fn args(&mut self, args: &[IdedExpr]) -> Result<Vec<Type>, String> {
        args.iter().map(|arg| self.expr(arg)).collect()
    }

    fn declared(&self, name: &str) -> bool {
        self.env.overloads.iter().any(|o| o.name == name)
    }

    fn resolve(&self, name: &str, member: bool, args: &[Type]) -> Result<Type, String> {
        if !self.declared(name) {
            return Err(format!(
                "undeclared reference to '{name}' (in container '')"
            ));
        }
        let mut results = Vec::new();
        for overload in self
            .env
            .overloads
            .iter()
            .filter(|o| o.name == name && o.member == member)
        {
            if overload.params.len() != args.len() {
                continue;
            }
            let mut bindings = BTreeMap::new();
            if overload
                .params
                .iter()
                .zip(args)
                .all(|(param, arg)| assignable(param, arg, &mut bindings))
            {
                results.push(substitute(&overload.result, &bindings));
            }
        }
        match results.as_slice() {
            [] => Err(no_overload(name, member, args)),
            [only] => Ok(only.clone()),
            // Several match only through `dyn`: the result is known if
            // they agree.
            [first, rest @ ..] => Ok(if rest.iter().all(|r| r == first) {
                first.clone()
            } else {
                Type::Dyn
            }),
        }
    }
}

fn no_overload(name: &str, member: bool, args: &[Type]) -> String {
    let shown = |types: &[Type]| {
        types
            .iter()
            .map(Type::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let applied = match (member, args.split_first()) {
        (true, Some((target, rest))) => format!("{target}.({})", shown(rest)),
        _ => format!("({})", shown(args)),
    };
    format!("found no matching overload for '{name}' applied to '{applied}'")
}

fn literal_type(literal: &LiteralValue) -> Type {
    match literal {
        LiteralValue::Boolean(_) => Type::Bool,
        LiteralValue::Bytes(_) => Type::Bytes,
        LiteralValue::Double(_) => Type::Double,
        LiteralValue::Int(_) => Type::Int,
        LiteralValue::Null => Type::Null,
        LiteralValue::String(_) => Type::String,
        LiteralValue::UInt(_) => Type::Uint,
    }
}

/// The type of `operand.field`, or cel-go's refusal.
fn field_type(operand: &Type, field: &str) -> Result<Type, String> {
    match operand {
        Type::Dyn => Ok(Type::Dyn),
        Type::Object(object) => object
            .fields
            .get(field)
            .cloned()
            .ok_or_else(|| format!("undefined field '{field}' (in {})", object.name)),
        Type::Map(key, value) if matches!(**key, Type::String | Type::Dyn) => Ok((**value).clone()),
        other => Err(format!("type '{other}' does not support field selection")),
    }
}

/// The one type both `a` and `b` are, letting `dyn` give way to the other.
fn join(a: &Type, b: &Type) -> Option<Type> {
    let mut bindings = BTreeMap::new();
    if assignable(a, b, &mut bindings) || assignable(b, a, &mut BTreeMap::new()) {
        Some(if a.contains_dyn() {
            b.clone()
        } else {
            a.clone()
        })
    } else {
        None
    }
}

/// The literal patterns an expression hands to `matches`, `find` and
/// `findAll`, which the API server compiles (RE2) with the expression.
pub fn regex_literals(source: &str) -> Result<Vec<String>, String> {
    let parsed = Parser::new()
        .enable_optional_syntax(true)
        .parse(source)
        .map_err(|errors| errors.to_string())?;
    let mut found = Vec::new();
    collect_regexes(&parsed, &mut found);
    Ok(found)
}

fn collect_regexes(node: &IdedExpr, found: &mut Vec<String>) {
    match &node.expr {
        Expr::Call(call) => {
            let pattern = match (call.func_name.as_str(), call.target.is_some()) {
                ("matches" | "find" | "findAll", true) => call.args.first(),
                ("matches", false) => call.args.get(1),
                _ => None,
            };
            if let Some(IdedExpr {
                expr: Expr::Literal(LiteralValue::String(text)),
                ..
            }) = pattern
            {
                found.push(text.inner().to_string());
            }
            if let Some(target) = &call.target {
                collect_regexes(target, found);
            }
            call.args.iter().for_each(|arg| collect_regexes(arg, found));
        }
        Expr::Select(select) => collect_regexes(&select.operand, found),
        Expr::List(items) => items
            .elements
            .iter()
            .for_each(|e| collect_regexes(e, found)),
        Expr::Map(entries) => {
            for entry in &entries.entries {
                if let EntryExpr::MapEntry(entry) = &entry.expr {
                    collect_regexes(&entry.key, found);
                    collect_regexes(&entry.value, found);
                }
            }
        }
        Expr::Comprehension(c) => {
            for part in [
                &c.iter_range,
                &c.accu_init,
                &c.loop_cond,
                &c.loop_step,
                &c.result,
            ] {
                collect_regexes(part, found);
            }
        }
        Expr::Struct(_) | Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
    }
}
