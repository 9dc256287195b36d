//! Pointing at the place in a TOML file that an error is about.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use toml_edit::{Item, Value};

/// One step of a path into the config: a table key or an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Key(String),
    Index(usize),
}

/// A path such as `rewards[1].options.pattern`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPath(pub Vec<Segment>);

impl KeyPath {
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.0.push(Segment::Key(key.into()));
        self
    }

    pub fn index(mut self, index: usize) -> Self {
        self.0.push(Segment::Index(index));
        self
    }

    pub fn parse_dotted(text: &str) -> Self {
        KeyPath(
            text.split('.')
                .map(|part| match part.parse::<usize>() {
                    Ok(index) => Segment::Index(index),
                    Err(_) => Segment::Key(part.to_owned()),
                })
                .collect(),
        )
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, segment) in self.0.iter().enumerate() {
            match segment {
                Segment::Key(key) if i == 0 => write!(f, "{key}")?,
                Segment::Key(key) => write!(f, ".{key}")?,
                Segment::Index(index) => write!(f, "[{index}]")?,
            }
        }
        Ok(())
    }
}

/// `file:line:column` (both 1-based, column in characters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    pub line: usize,
    pub column: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file.display(), self.line, self.column)
    }
}

impl Location {
    pub fn at_offset(file: &Path, text: &str, offset: usize) -> Self {
        let offset = offset.min(text.len());
        let before = text.get(..offset).unwrap_or(text);
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = before.get(line_start..).map_or(0, |s| s.chars().count()) + 1;
        Location {
            file: file.to_path_buf(),
            line,
            column,
        }
    }
}

/// The span of the deepest part of `path` present in `text`: the key itself when it is
/// written in the file, else the closest enclosing table.
pub fn find_span(text: &str, path: &KeyPath) -> Option<Range<usize>> {
    let document = toml_edit::Document::parse(text).ok()?;
    let mut node = Node::Table(document.as_table());
    let mut best = None;
    for segment in &path.0 {
        let Some((span, next)) = node.child(segment) else {
            break;
        };
        if span.is_some() {
            best = span;
        }
        node = next;
    }
    best
}

#[derive(Clone, Copy)]
enum Node<'a> {
    Table(&'a toml_edit::Table),
    Item(&'a Item),
}

impl<'a> Node<'a> {
    fn child(self, segment: &Segment) -> Option<(Option<Range<usize>>, Node<'a>)> {
        let table_entry = |(key, item): (&toml_edit::Key, &'a Item)| {
            (key.span().or_else(|| item.span()), Node::Item(item))
        };
        match (segment, self) {
            (Segment::Key(key), Node::Table(table)) => table.get_key_value(key).map(table_entry),
            (Segment::Key(key), Node::Item(Item::Table(table))) => {
                table.get_key_value(key).map(table_entry)
            }
            (Segment::Key(key), Node::Item(Item::Value(Value::InlineTable(table)))) => {
                table.get_key_value(key).map(table_entry)
            }
            (Segment::Index(index), Node::Item(Item::ArrayOfTables(tables))) => {
                let table = tables.get(*index)?;
                Some((table.span(), Node::Table(table)))
            }
            _ => None,
        }
    }
}
