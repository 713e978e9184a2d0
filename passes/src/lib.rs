//! Named rewrite passes over the IR (issue [2]). Nothing here yet: the CPU backend runs the
//! unfused graph.
