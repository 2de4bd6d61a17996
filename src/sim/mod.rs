//! The engine model behind the incident replay (issue 3).
