//! The expressions `plan.json` carries — scalar arguments such as `(tokens)*9` or `tokens-1`, and
//! kernel grids such as `(((tokens * n) + 7) / 8)` or `min(8, 264 / tokens)` — evaluated at
//! launch time. Integers with C's truncating division unless a float appears (`0.125`), then
//! floats throughout; `min` and `max` of two.

use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
}

impl Value {
    pub fn as_i64(self) -> i64 {
        match self {
            Value::Int(i) => i,
            Value::Float(f) => f as i64,
        }
    }
    pub fn as_f64(self) -> f64 {
        match self {
            Value::Int(i) => i as f64,
            Value::Float(f) => f,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("expression `{text}`: {what}")]
pub struct ExprError {
    pub text: String,
    pub what: String,
}

/// Evaluate `text` with the given variables.
pub fn eval(text: &str, vars: &HashMap<&str, Value>) -> Result<Value, ExprError> {
    Compiled::parse(text)?.eval(&|name| vars.get(name).copied())
}

/// An expression parsed once, to evaluate at every launch (the runtime prepares a plan's
/// expressions when it loads the plan, not at each step).
#[derive(Debug, Clone, PartialEq)]
pub struct Compiled {
    text: String,
    root: Node,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Num(Value),
    Name(String),
    Arith(char, Box<Node>, Box<Node>),
    /// `min` (true) or `max` (false) of two.
    Pick(bool, Box<Node>, Box<Node>),
}

impl Compiled {
    pub fn parse(text: &str) -> Result<Self, ExprError> {
        let err = |what: String| ExprError {
            text: text.into(),
            what,
        };
        let tokens = lex(text).map_err(err)?;
        let mut p = Parser { tokens: &tokens, at: 0 };
        let root = p.sum().map_err(err)?;
        if p.at != tokens.len() {
            return Err(err(format!("unexpected `{:?}`", tokens[p.at])));
        }
        Ok(Self {
            text: text.into(),
            root,
        })
    }

    /// The value, each name looked up in `vars`.
    pub fn eval(&self, vars: &dyn Fn(&str) -> Option<Value>) -> Result<Value, ExprError> {
        self.root.eval(vars).map_err(|what| ExprError {
            text: self.text.clone(),
            what,
        })
    }
}

impl Node {
    fn eval(&self, vars: &dyn Fn(&str) -> Option<Value>) -> Result<Value, String> {
        Ok(match self {
            Node::Num(v) => *v,
            Node::Name(n) => vars(n).ok_or_else(|| format!("unknown name `{n}`"))?,
            Node::Arith(op, a, b) => arith(*op, a.eval(vars)?, b.eval(vars)?)?,
            Node::Pick(min, a, b) => {
                let (a, b) = (a.eval(vars)?, b.eval(vars)?);
                let pick_first = match (a, b) {
                    (Value::Int(x), Value::Int(y)) => (x < y) == *min,
                    (a, b) => (a.as_f64() < b.as_f64()) == *min,
                };
                if pick_first {
                    a
                } else {
                    b
                }
            }
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Num(Value),
    Name(String),
    Op(char),
}

fn lex(text: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() || c == '.' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_digit()
                    || chars[i] == '.'
                    || chars[i] == 'e'
                    || ((chars[i] == '-' || chars[i] == '+') && chars[i - 1] == 'e'))
            {
                i += 1;
            }
            let s: String = chars[start..i].iter().collect();
            let s = s.trim_end_matches('f');
            let v = match s.parse::<i64>() {
                Ok(n) => Value::Int(n),
                Err(_) => Value::Float(s.parse().map_err(|_| format!("bad number `{s}`"))?),
            };
            out.push(Token::Num(v));
            if i < chars.len() && chars[i] == 'f' {
                i += 1;
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Token::Name(chars[start..i].iter().collect()));
        } else if "+-*/%(),".contains(c) {
            out.push(Token::Op(c));
            i += 1;
        } else {
            return Err(format!("unexpected `{c}`"));
        }
    }
    Ok(out)
}

struct Parser<'a> {
    tokens: &'a [Token],
    at: usize,
}

fn arith(op: char, a: Value, b: Value) -> Result<Value, String> {
    Ok(match (a, b) {
        (Value::Int(x), Value::Int(y)) => Value::Int(match op {
            '+' => x + y,
            '-' => x - y,
            '*' => x * y,
            '/' | '%' if y == 0 => return Err("division by zero".into()),
            '/' => x / y,
            _ => x % y,
        }),
        (a, b) => {
            let (x, y) = (a.as_f64(), b.as_f64());
            Value::Float(match op {
                '+' => x + y,
                '-' => x - y,
                '*' => x * y,
                '/' => x / y,
                _ => x % y,
            })
        }
    })
}

impl Parser<'_> {
    fn peek_op(&self) -> Option<char> {
        match self.tokens.get(self.at) {
            Some(Token::Op(c)) => Some(*c),
            _ => None,
        }
    }

    fn expect(&mut self, op: char) -> Result<(), String> {
        if self.peek_op() != Some(op) {
            return Err(format!("missing `{op}`"));
        }
        self.at += 1;
        Ok(())
    }

    fn sum(&mut self) -> Result<Node, String> {
        let mut v = self.product()?;
        while let Some(op @ ('+' | '-')) = self.peek_op() {
            self.at += 1;
            v = Node::Arith(op, Box::new(v), Box::new(self.product()?));
        }
        Ok(v)
    }

    fn product(&mut self) -> Result<Node, String> {
        let mut v = self.atom()?;
        while let Some(op @ ('*' | '/' | '%')) = self.peek_op() {
            self.at += 1;
            v = Node::Arith(op, Box::new(v), Box::new(self.atom()?));
        }
        Ok(v)
    }

    fn atom(&mut self) -> Result<Node, String> {
        let token = self.tokens.get(self.at).cloned().ok_or("unexpected end")?;
        self.at += 1;
        match token {
            Token::Num(v) => Ok(Node::Num(v)),
            Token::Name(f) if (f == "min" || f == "max") && self.peek_op() == Some('(') => {
                self.at += 1;
                let a = self.sum()?;
                self.expect(',')?;
                let b = self.sum()?;
                self.expect(')')?;
                Ok(Node::Pick(f == "min", Box::new(a), Box::new(b)))
            }
            Token::Name(n) => Ok(Node::Name(n)),
            Token::Op('-') => Ok(Node::Arith(
                '-',
                Box::new(Node::Num(Value::Int(0))),
                Box::new(self.atom()?),
            )),
            Token::Op('(') => {
                let v = self.sum()?;
                self.expect(')')?;
                Ok(v)
            }
            Token::Op(c) => Err(format!("unexpected `{c}`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluates_plan_expressions() {
        let vars = HashMap::from([
            ("tokens", Value::Int(5)),
            ("n", Value::Int(9)),
            ("first", Value::Int(3)),
        ]);
        assert_eq!(eval("(((tokens * n) + 7) / 8)", &vars).unwrap(), Value::Int(6));
        assert_eq!(eval("(tokens-1)*576+0", &vars).unwrap(), Value::Int(2304));
        assert_eq!(eval("first", &vars).unwrap(), Value::Int(3));
        assert_eq!(eval("0.125", &vars).unwrap(), Value::Float(0.125));
        assert_eq!(eval("-7 % 3", &vars).unwrap(), Value::Int(-1));
        assert!(eval("tokens / 0", &vars).is_err());
        assert!(eval("tokens +", &vars).is_err());
        assert!(eval("nope", &vars).is_err());
        assert_eq!(eval("min(8, 40 / tokens)", &vars).unwrap(), Value::Int(8));
        assert_eq!(
            eval("max(1, min(8, 264 / (tokens * n)))", &vars).unwrap(),
            Value::Int(5)
        );
        assert_eq!(eval("max(2, 0.5)", &vars).unwrap(), Value::Int(2));
        assert_eq!(eval("min(tokens, first) * 2", &vars).unwrap(), Value::Int(6));
        assert!(eval("min(1)", &vars).is_err());
        assert!(eval("min(1, 2", &vars).is_err());
    }

    /// Parsed once, evaluated with other values each time; errors found only with values (a
    /// name not given, a division by zero) come from `eval` and name the expression.
    #[test]
    fn compiled_expressions_evaluate_again_with_new_values() {
        let grid = Compiled::parse("max(1, (tokens * n + 7) / 8)").unwrap();
        for (tokens, want) in [(0, 1), (1, 2), (5, 6)] {
            let vars = |name: &str| match name {
                "tokens" => Some(Value::Int(tokens)),
                "n" => Some(Value::Int(9)),
                _ => None,
            };
            assert_eq!(grid.eval(&vars).unwrap(), Value::Int(want));
        }
        let err = Compiled::parse("tokens / first")
            .unwrap()
            .eval(&|_| Some(Value::Int(0)))
            .unwrap_err();
        assert_eq!(err.text, "tokens / first");
        assert!(err.what.contains("division by zero"));
        assert!(Compiled::parse("seqs").unwrap().eval(&|_| None).is_err());
        assert!(Compiled::parse("(1").is_err());
    }
}
